"""plait-train's plugin module: the Tinker losses, by lazy targets (importing it imports no
torch)."""

from __future__ import annotations

from plait.api import RegisterLoss, hookimpl

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")


@hookimpl
def plait_register_losses(register: RegisterLoss) -> None:
    for name in LOSSES:
        register(
            name,
            f"plait_train.losses:{name}",
            description=f"Tinker-compatible {name} loss (token sum)",
        )
