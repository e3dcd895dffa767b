"""plait-openai-engine: the "openai" inference engine, for any OpenAI-compatible completions
server."""
