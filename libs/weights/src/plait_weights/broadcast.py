"""The trainer's side of a weight broadcast to inference engines (`BroadcastWeightReceiver`).

Rendezvous (gloo): rank 0 (the trainer) owns a `TCPStore` at `group.master_address:master_port`;
every rank builds its gloo group on a `PrefixStore` named "plait-weights" over it. plait's engines
join the same way (vLLM through plait's worker extension, the SGLang fake server directly), so
one trainer-side helper serves both on CPU. NCCL groups on GPUs rendezvous the engine's own way
(see `open_group`). Imports torch on use.

    group = BroadcastGroup("127.0.0.1", port, rank_offset=1, world_size=1 + ranks, backend="gloo")
    pg, _ = await asyncio.gather(asyncio.to_thread(open_group, group, 0),
                                 engine.join_weight_broadcast(group))
    await asyncio.gather(engine.receive_weight_broadcast(metas(tensors), version),
                         asyncio.to_thread(broadcast, pg, tensors))
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from plait_weights.capabilities import BroadcastGroup, TensorMeta

STORE_PREFIX = "plait-weights"


def open_group(group: BroadcastGroup, rank: int, timeout_s: float = 600.0) -> Any:
    """This process's member of the broadcast group (rank 0 also hosts the store)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        group.master_address,
        group.master_port,
        group.world_size,
        is_master=rank == 0,
        timeout=timeout,
    )
    if group.backend != "gloo":
        # NCCL groups rendezvous the engine's own way (vLLM: its StatelessProcessGroup, whose
        # trainer side is vLLM's NCCLTrainerWeightTransferEngine; SGLang: torch's tcp://
        # init_method under the group name); this helper speaks only plait's gloo rendezvous.
        raise ValueError(
            f"plait_weights.broadcast.open_group speaks gloo; got backend {group.backend!r}"
        )
    return dist.ProcessGroupGloo(
        dist.PrefixStore(STORE_PREFIX, store), rank, group.world_size, timeout
    )


def tensor_metas(tensors: Mapping[str, Any]) -> list[TensorMeta]:
    """What receivers need to know of each tensor, in broadcast order."""
    return [
        TensorMeta(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        for name, t in tensors.items()
    ]


def broadcast(process_group: Any, tensors: Mapping[str, Any]) -> None:
    """Broadcast `tensors` from rank 0, in order (blocking; run it in a thread)."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    for tensor in tensors.values():
        process_group.broadcast([tensor.detach().contiguous()], options).wait()
