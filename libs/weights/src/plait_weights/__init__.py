"""Weight sync: payloads (full, bucketed, delta), transports (in-process, disk,
torch.distributed), layouts."""
