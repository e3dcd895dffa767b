"""Qwen3 / Qwen3-Instruct-2507 / Qwen3.5 renderers for plait (see README.md)."""
