"""The one-process torch.distributed group and megatron-core parallel state the engine runs in.

megatron-core's modules look up their tensor/pipeline-parallel groups in `parallel_state`, so a
single process still needs a process group (world size 1: gloo on the CPU, NCCL on CUDA, over an
in-process store) and `initialize_model_parallel(1, 1)`. Several engines in one process (tests,
a reference and a policy model) share them; the last one to close tears down what the first set
up. A process group someone else set up is used as it is, if it has one rank.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from plait.api import ConfigError

_lock = threading.Lock()
_users = 0
_owned: dict[str, bool] = {}


def acquire(device: torch.device) -> None:
    from megatron.core import parallel_state

    global _users
    with _lock:
        if _users == 0:
            _owned["process_group"] = not dist.is_initialized()
            if _owned["process_group"]:
                backend = "nccl" if device.type == "cuda" else "gloo"
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            if dist.get_world_size() != 1:
                raise ConfigError(
                    "trainer.engine",
                    f"the Megatron trainer runs in one process, but torch.distributed has "
                    f"{dist.get_world_size()} ranks",
                    fix="start plait without torchrun; for data/tensor parallelism use "
                    "trainer.engine = 'fsdp2'",
                )
            _owned["model_parallel"] = not parallel_state.model_parallel_is_initialized()
            if _owned["model_parallel"]:
                parallel_state.initialize_model_parallel(1, 1)
        _users += 1


def release() -> None:
    from megatron.core import parallel_state

    global _users
    with _lock:
        _users -= 1
        if _users:
            return
        if _owned.pop("model_parallel", False):
            parallel_state.destroy_model_parallel()
        if _owned.pop("process_group", False):
            dist.destroy_process_group()
