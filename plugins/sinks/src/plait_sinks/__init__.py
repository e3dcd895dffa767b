"""plait's metric sinks beyond metrics.jsonl: `console`, `tensorboard` and `dashboard` (and
`plait plot`)."""
