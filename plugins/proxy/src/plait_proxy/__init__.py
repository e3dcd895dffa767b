"""plait-proxy: OpenAI- and Anthropic-compatible endpoints that record the token ids they sample."""
