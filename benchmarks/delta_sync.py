"""Delta weight sync after real optimizer steps: bytes sent against a full sync, and whether the
engine's weights end bit-identical to the trainer's.

A plait-torch trainer (float32 master weights, Adam) takes RL steps (importance-sampling loss on
random token data) and after each one pushes its weights to a plait-torch inference engine that
serves bfloat16, once as a sparse delta (`payload = "delta"`: only the bfloat16 elements that
changed, each as a step of its bit pattern, `plait_weights.patch`; the engine checks the base's
checksum before and the result's BLAKE2b checksum after applying) and, for comparison, the size a
full push would have had. The engine's weights are checksummed against the trainer's (cast to
bfloat16) after every push.

Models: tiny-qwen3 (19.7M parameters) and a ~50M-parameter Qwen3 built at run time from a config
(random init, same tokenizer). Learning rates: 1e-6 (a common RL rate for LLMs) and 1e-5.

    python benchmarks/delta_sync.py [--steps 5]

Writes benchmarks/results/delta_sync.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from plait.models import ResolvedModel
from plait.types import AdamParams
from plait_testing.models import build_resized_qwen3, materialize_model
from plait_testing.trainer import rl_datum
from plait_torch.inference import TorchInferenceEngine
from plait_torch.trainer import TorchTrainer
from plait_weights import patch as weight_patch
from plait_weights.sync import InProcessSync, InProcessSyncOptions

ROOT = Path(__file__).resolve().parents[1]
QWEN3_50M = {
    "hidden_size": 320,
    "intermediate_size": 960,
    "num_hidden_layers": 6,
    "num_attention_heads": 10,
    "num_key_value_heads": 5,
    "head_dim": 32,
}


def rl_step(trainer: TorchTrainer, rng: np.random.Generator, learning_rate: float) -> None:
    data = [
        rl_datum(
            rng.integers(0, 150_000, 48).tolist(),
            16,
            rng.normal(-2.0, 0.5, 32).tolist(),
            float(rng.normal()),
        )
        for _ in range(8)
    ]
    trainer.forward_backward(data, "importance_sampling")
    trainer.optim_step(AdamParams(learning_rate=learning_rate))


def measure(model: ResolvedModel, learning_rate: float, steps: int) -> dict[str, Any]:
    trainer = TorchTrainer(model, seed=0)
    engine = TorchInferenceEngine(attrs.evolve(model, dtype="bfloat16"), seed=0)
    sync = InProcessSync(options=InProcessSyncOptions(payload="delta", dtype="bfloat16"))
    rng = np.random.default_rng(0)
    params = sum(t.numel() for _, t in trainer.export_weights())

    async def body() -> list[dict[str, Any]]:
        rows = []
        for step in range(steps + 1):
            if step:
                rl_step(trainer, rng, learning_rate)
            stats = await sync.push(trainer, [engine], trainer.weight_version)
            served = weight_patch.checksum(
                (n, t.to(torch.bfloat16)) for n, t in trainer.export_weights()
            )
            held = weight_patch.checksum(engine.model.named_parameters())
            rows.append(
                {
                    "step": step,
                    "bytes": stats.bytes,
                    "full_bytes": stats.full_bytes,
                    "bytes_fraction": stats.bytes / stats.full_bytes,
                    "delta_fraction": stats.delta_fraction,
                    "seconds": stats.seconds,
                    "bit_identical": served == held,
                }
            )
        await engine.close()
        return rows

    rows = asyncio.run(body())
    trainer.close()
    deltas = rows[1:]
    return {
        "model": model.name,
        "parameters": params,
        "learning_rate": learning_rate,
        "steps": rows,
        "max_bytes_fraction": max(r["bytes_fraction"] for r in deltas),
        "first_step_bytes_fraction": deltas[0][
            "bytes_fraction"
        ],  # Adam's first step moves every element by lr
        "max_bytes_fraction_after_first_step": max(r["bytes_fraction"] for r in deltas[1:]),
        "mean_delta_fraction": float(np.mean([r["delta_fraction"] for r in deltas])),
        "all_bit_identical": all(r["bit_identical"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="optimizer steps per model and rate (>= 2)"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "delta_sync.json"
    )
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    with tempfile.TemporaryDirectory() as tmp:
        tiny = materialize_model("tiny-qwen3", Path(tmp) / "tiny-qwen3")
        models = [tiny, build_resized_qwen3(tiny.path, Path(tmp) / "qwen3-50m", **QWEN3_50M)]
        started = time.time()
        results = [measure(m, lr, args.steps) for m in models for lr in (1e-6, 1e-5)]
    for r in results:
        print(
            f"{r['model']:>11} ({r['parameters'] / 1e6:.1f}M) lr={r['learning_rate']:g}: "
            f"bytes of full: first step {r['first_step_bytes_fraction']:.2%}, "
            f"later <= {r['max_bytes_fraction_after_first_step']:.2%}; "
            f"{r['mean_delta_fraction']:.2%} of elements; "
            f"bit-identical={r['all_bit_identical']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "delta_sync",
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "wire_dtype": "bfloat16",
                "master_dtype": "float32",
                "seconds": time.time() - started,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
