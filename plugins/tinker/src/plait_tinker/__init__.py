"""`plait serve tinker`: a Tinker-compatible training service (the tinker SDK 0.38 wire protocol)
on plait's engines, many LoRA training runs on one base model, for one or many tenants."""
