"""plait-torch: reference trainer and inference engines on plain PyTorch + transformers.

Nothing is imported here: plugin discovery loads `plait_torch.plugin`, which registers lazy
"module:attribute" targets, so that discovering plugins never imports torch.
"""
