"""A weight receiver process for the distributed-sync tests: a torch inference engine (or, for
tensor-parallel shards, a WeightStore) fed by plait_weights.distributed.WeightReceiver. On exit it
writes the version and checksum of what it holds to REPORT.

usage: python weight_receiver_main.py MODEL_DIR DTYPE PORT RANK WORLD TP_RANK REPORT [store]
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from plait.api import ResolvedModel
from plait_weights import patch as weight_patch
from plait_weights.distributed import WeightReceiver, WeightStore


async def main() -> None:
    model_dir, dtype, port, rank, world, tp_rank, report = sys.argv[1:8]
    use_store = sys.argv[8:] == ["store"]
    if use_store:
        target = WeightStore()
    else:
        from plait_torch.inference import TorchInferenceEngine

        target = TorchInferenceEngine(
            ResolvedModel("tiny-qwen3", Path(model_dir), Path(model_dir), dtype=dtype)
        )
    receiver = WeightReceiver(
        target,
        master_address="127.0.0.1",
        master_port=int(port),
        rank=int(rank),
        world_size=int(world),
        name=f"test-receiver-{rank}",
        tp_rank=int(tp_rank),
        timeout_s=60,
    )
    await receiver.run()
    held = target.tensors.items() if use_store else target.model.named_parameters()
    Path(report).write_text(
        json.dumps(
            {
                "version": target.weight_version,
                "pushes": receiver.pushes,
                "checksum": weight_patch.checksum(held),
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
