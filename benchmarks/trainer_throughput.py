"""Trainer throughput and MFU of plait-torch's trainer, against the machine's measured matmul peak.

One run measures both sides of the ratio: the peak FLOP/s of square matmuls in the trainer's
compute dtype (before and after the training runs; the higher is used), and the model FLOP/s that
forward_backward + optim_step achieve on a fixed batch (6·N + attention term per token, see
plait_train.perf). Prints a summary and writes benchmarks/results/trainer_throughput[_smollm2].json.

    python benchmarks/trainer_throughput.py              # tiny Qwen3 (seconds)
    python benchmarks/trainer_throughput.py --smollm2    # SmolLM2-135M (minutes on 2 cores)
"""

from __future__ import annotations

import argparse

import engine_bench as common
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.model_arguments(parser)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--activation-checkpointing", action="store_true")
    args = parser.parse_args()

    from plait.types import AdamParams
    from plait_testing.trainer import sft_datum
    from plait_torch.options import TorchTrainerOptions
    from plait_torch.trainer import TorchTrainer
    from plait_train.perf import measure_matmul_flops

    model = common.resolve(args)
    trainer = TorchTrainer(
        model,
        options=TorchTrainerOptions(
            micro_batch_tokens=args.micro_batch_tokens,
            activation_checkpointing=args.activation_checkpointing,
            threads=args.threads,
        ),
    )
    peak_source = trainer.peak_flops.source
    compute_dtype = next(t for _, t in trainer.export_weights()).dtype
    peaks = [trainer.peak_flops_per_s]

    rng = np.random.default_rng(0)
    vocab = trainer.vocab_rows
    data = [
        sft_datum(rng.integers(0, vocab, size=args.seq_len + 1).tolist()) for _ in range(args.batch)
    ]
    adam = AdamParams(learning_rate=1e-5)

    def step() -> dict[str, float]:
        out = trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(adam)
        return out.metrics

    step()  # warm-up: allocator, kernels, optimizer state
    seconds, metrics = [], {}
    for _ in range(args.repeats):
        elapsed, metrics = common.timed(step)
        seconds.append(elapsed)
    peaks.append(measure_matmul_flops(trainer.device, compute_dtype))
    peak = max(peaks)

    tokens = metrics["train_tokens:sum"]
    flops = metrics["model_flops:sum"]
    step_s = common.median(seconds)
    result = {
        "benchmark": "trainer_throughput",
        "model": model.name,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "micro_batch_tokens": args.micro_batch_tokens,
        "activation_checkpointing": args.activation_checkpointing,
        "repeats": args.repeats,
        "step_seconds": seconds,
        "step_seconds_median": step_s,
        "train_tokens_per_step": tokens,
        "model_flops_per_step": flops,
        "flops_per_token": trainer.flops_per_token(args.seq_len),
        "tokens_per_s": tokens / step_s,
        "model_flops_per_s": flops / step_s,
        "peak_flops_per_s": peak,
        "peak_flops_measurements": peaks,
        "peak_source": peak_source,
        "mfu": flops / step_s / peak,
        "machine": common.machine(),
    }
    path = common.write("trainer_throughput", args, result)
    print(
        f"{model.name}: {tokens / step_s:,.0f} train tokens/s "
        f"(median step {step_s:.2f} s over {args.repeats}), "
        f"model {flops / step_s / 1e9:.1f} GFLOP/s "
        f"vs peak {peak / 1e9:.1f} GFLOP/s ({peak_source}) "
        f"-> MFU {result['mfu']:.1%}\nwrote {path}"
    )


if __name__ == "__main__":
    main()
