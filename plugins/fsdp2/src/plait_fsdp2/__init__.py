"""plait-fsdp2: the FSDP2 trainer engine (`trainer.engine = "fsdp2"`)."""
