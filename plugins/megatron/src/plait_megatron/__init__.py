"""plait-megatron: Hugging Face <-> Megatron-core weights and models for Qwen3."""
