"""The run: `loop` drives it top to bottom, `steps` are its parts, `schedules` the sync and async
ways of interleaving them, `state` and `checkpoint` what survives a restart, `report` its
metrics."""
