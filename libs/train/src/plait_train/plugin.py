"""plait-train's plugin module: the losses, by lazy targets (importing it imports no torch)."""

from __future__ import annotations

from plait.api import RegisterLoss, hookimpl

LOSSES = {
    "cross_entropy": "Tinker-compatible cross_entropy loss (token sum)",
    "importance_sampling": "Tinker-compatible importance_sampling loss (token sum)",
    "ppo": "Tinker-compatible ppo loss (token sum; DAPO's clip-higher by its thresholds)",
    "cispo": "Tinker-compatible cispo loss (token sum)",
    "dro": "Tinker-compatible dro loss (token sum)",
    "gspo": "GSPO-token: PPO clipping on the sequence-level ratio (token sum)",
    "ppo_dual_clip": "dual-clip PPO: ppo with the loss of negative advantages bounded (token sum)",
    "value": "a critic's clipped squared error to its returns (a value model's, token sum)",
}


@hookimpl
def plait_register_losses(register: RegisterLoss) -> None:
    for name, description in LOSSES.items():
        register(name, f"plait_train.losses:{name}", description=description)
