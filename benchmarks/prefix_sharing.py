"""Training-step layouts side by side: prefix sharing vs dense on GRPO batches, packing vs padding
on skewed lengths, and activation checkpointing's memory saved vs compute added.

Everything runs through `plait_train.StepRunner` (the code plait-torch and plait-fsdp2 share):
one forward_backward of the same batch in each layout, on the same model, in one run. Models are
random Qwen3s built from a config at start-up (nothing is downloaded):

- `body`: hidden 256, 8 layers, vocabulary 8192. Its output head costs about 1/3 of the decoder
  per token, as in Qwen3-0.6B (for larger models the head matters even less). Prefix sharing
  saves decoder work only (the head runs on response tokens either way), so this is the model
  whose ratios speak for real ones.
- `tiny-qwen3`: the test model (hidden 128, 2 layers, 151936-token vocabulary): its head costs
  ~40x its decoder, so sharing the prompt saves little; one configuration, reported for honesty.

Activation-checkpointing memory is the peak resident memory a forward_backward adds, each mode in
a fresh subprocess (CPU has no allocator statistics; glibc maps large tensors directly, so RSS
follows live activations).

    python benchmarks/prefix_sharing.py              # ~15 minutes on 2 busy cores
    python benchmarks/prefix_sharing.py --quick      # smaller batches, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
from typing import Any

import engine_bench as common
import numpy as np

MODELS = {
    "body": {
        "vocab_size": 8192,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
    "tiny-qwen3": {
        "vocab_size": 151936,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
}


def build_runner(
    model_name: str,
    *,
    packing: bool,
    prefix_sharing: bool,
    checkpointing: str = "none",
    micro_batch_tokens: int = 16384,
) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from plait_train.checkpointing import apply_activation_checkpointing
    from plait_train.layout import LayoutOptions
    from plait_train.perf import FlopsModel
    from plait_train.scorer import TokenScorer
    from plait_train.step import StepRunner

    torch.manual_seed(0)
    config = Qwen3Config(
        **MODELS[model_name],
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    model = Qwen3ForCausalLM(config)
    model.config.use_cache = False
    scorer = TokenScorer(model)
    flops = FlopsModel.of(model)
    if checkpointing != "none":
        apply_activation_checkpointing(model, checkpointing)
    scorer.train()
    return StepRunner(
        scorer,
        layout=LayoutOptions(micro_batch_tokens, packing=packing, prefix_sharing=prefix_sharing),
        device=torch.device("cpu"),
        flops=flops,
        vocab_rows=config.vocab_size,
    )


def grpo_batch(
    rng: np.random.Generator,
    vocab: int,
    *,
    groups: int,
    group_size: int,
    prompt: int,
    response: int,
) -> list[Any]:
    """`groups` GRPO groups: each a prompt of `prompt` tokens and `group_size` responses of
    0.5-1.5x `response` tokens (mean `response`)."""
    from plait_testing.trainer import rl_datum

    data = []
    for _ in range(groups):
        prompt_ids = rng.integers(0, vocab, prompt).tolist()
        for _ in range(group_size):
            n = int(rng.integers(response // 2, response + response // 2 + 1))
            data.append(
                rl_datum(
                    prompt_ids + rng.integers(0, vocab, n).tolist(),
                    prompt,
                    (-1.0 - rng.random(n)).tolist(),
                    advantage=float(rng.normal()),
                )
            )
    return data


def skewed_batch(
    rng: np.random.Generator, vocab: int, count: int, median: int, longest: int
) -> list[Any]:
    """SFT sequences with log-normal lengths (most short, a few long), as RL responses are."""
    from plait_testing.trainer import sft_datum

    lengths = np.clip(rng.lognormal(np.log(median), 0.9, count).astype(int), 8, longest)
    lengths[0] = longest  # the long tail is always there
    return [sft_datum(rng.integers(0, vocab, int(n) + 1).tolist()) for n in lengths]


def time_layouts(
    model_name: str, data: list[Any], loss: str, layouts: dict[str, dict[str, Any]], repeats: int
) -> dict[str, dict[str, Any]]:
    """forward_backward seconds of each layout, its loss and its computed token count. The layouts
    take turns (load from other processes hits each alike) and ratios use each one's fastest
    repeat (the least disturbed; on a shared machine medians wander)."""
    runners = {name: build_runner(model_name, **kwargs) for name, kwargs in layouts.items()}
    results: dict[str, dict[str, Any]] = {name: {"seconds": []} for name in layouts}

    def step(name: str) -> Any:
        runner = runners[name]
        out = runner.run(data, loss, None, backward=True)
        runner.scorer.zero_grad(set_to_none=True)
        return out

    for name in layouts:
        step(name)  # warm-up
    for _ in range(repeats):
        for name in layouts:
            seconds, out = common.timed(lambda name=name: step(name))
            results[name]["seconds"].append(seconds)
            results[name]["loss"] = sum(m.get("loss:sum", 0.0) for m, _ in out.parts)
            results[name]["forward_tokens"] = out.totals["forward_tokens:sum"]
            results[name]["prefix_shared_tokens"] = out.totals["prefix_shared_tokens:sum"]
    for result in results.values():
        result["median_s"] = common.median(result["seconds"])
        result["fastest_s"] = min(result["seconds"])
    return results


def prefix_sharing_section(
    args: argparse.Namespace, rng: np.random.Generator
) -> list[dict[str, Any]]:
    response = 4 if args.quick else 8
    rows = []
    # tiny-qwen3 only where the effect is largest: its head dominates every configuration alike.
    cases = [("body", r, g) for r in (4, 16) for g in (8, 16)] + [("tiny-qwen3", 16, 16)]
    for model_name, ratio, group_size in cases:
        vocab = MODELS[model_name]["vocab_size"]
        data = grpo_batch(
            rng, vocab, groups=2, group_size=group_size, prompt=ratio * response, response=response
        )
        results = time_layouts(
            model_name,
            data,
            "importance_sampling",
            {
                "dense": {"packing": True, "prefix_sharing": False},
                "shared": {"packing": True, "prefix_sharing": True},
            },
            args.repeats,
        )
        row = {
            "model": model_name,
            "prompt_to_response": f"{ratio}:1",
            "group_size": group_size,
            "groups": 2,
            "prompt_tokens": ratio * response,
            "mean_response_tokens": response,
            "layouts": results,
            "speedup_shared_vs_dense": results["dense"]["fastest_s"]
            / results["shared"]["fastest_s"],
            "computed_token_ratio": results["dense"]["forward_tokens"]
            / results["shared"]["forward_tokens"],
            "loss_rel_diff": abs(results["shared"]["loss"] - results["dense"]["loss"])
            / max(abs(results["dense"]["loss"]), 1e-9),
        }
        rows.append(row)
        print(
            f"prefix sharing {model_name:10s} {ratio:2d}:1 group {group_size:2d}: "
            f"{row['speedup_shared_vs_dense']:.2f}x vs dense (packed) "
            f"({row['computed_token_ratio']:.1f}x fewer tokens computed)",
            flush=True,
        )
    return rows


def packing_section(args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    count, median, longest = (8, 16, 128) if args.quick else (24, 32, 384)
    data = skewed_batch(rng, MODELS["body"]["vocab_size"], count, median, longest)
    lengths = [len(d.model_input.to_ints()) for d in data]
    results = time_layouts(
        "body",
        data,
        "cross_entropy",
        {
            "padded": {
                "packing": False,
                "prefix_sharing": False,
                "micro_batch_tokens": 4 * longest,
            },
            "packed": {"packing": True, "prefix_sharing": False, "micro_batch_tokens": 4 * longest},
        },
        args.repeats,
    )
    row = {
        "model": "body",
        "sequences": count,
        "lengths": {
            "median": float(np.median(lengths)),
            "mean": float(np.mean(lengths)),
            "max": max(lengths),
            "total": sum(lengths),
        },
        "micro_batch_tokens": 4 * longest,
        "layouts": results,
        "speedup_packed_vs_padded": results["padded"]["fastest_s"] / results["packed"]["fastest_s"],
        "computed_token_ratio": results["padded"]["forward_tokens"]
        / results["packed"]["forward_tokens"],
        "loss_rel_diff": abs(results["packed"]["loss"] - results["padded"]["loss"])
        / abs(results["padded"]["loss"]),
    }
    print(
        f"packing: {row['speedup_packed_vs_padded']:.2f}x vs padding "
        f"({row['computed_token_ratio']:.1f}x fewer slots computed)",
        flush=True,
    )
    return row


def checkpointing_batch(quick: bool) -> list[Any]:
    from plait_testing.trainer import sft_datum

    rng = np.random.default_rng(1)
    sequences, length = (2, 128) if quick else (4, 512)
    return [
        sft_datum(rng.integers(0, MODELS["body"]["vocab_size"], length + 1).tolist())
        for _ in range(sequences)
    ]


def checkpointing_child(mode: str, quick: bool) -> None:
    """One process, one mode: the peak resident memory one forward_backward adds."""
    data = checkpointing_batch(quick)
    runner = build_runner("body", packing=False, prefix_sharing=False, checkpointing=mode)
    runner.run(data, "cross_entropy", None, backward=True)  # warm-up: gradients allocated once
    runner.scorer.zero_grad(set_to_none=False)
    before = _rss_bytes()
    peak = [before]
    done = threading.Event()

    def sample() -> None:  # torch ops release the GIL, so this sees the step's peak
        while not done.wait(0.001):
            peak[0] = max(peak[0], _rss_bytes())

    sampler = threading.Thread(target=sample)
    sampler.start()
    runner.run(data, "cross_entropy", None, backward=True)
    done.set()
    sampler.join()
    print(json.dumps({"mode": mode, "peak_rss_added_bytes": peak[0] - before}))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def checkpointing_section(args: argparse.Namespace) -> dict[str, Any]:
    """Memory: each mode in a fresh process. Time: the modes interleaved in this one."""
    modes = ("none", "selective", "full")
    memory = {}
    for mode in modes:
        command = [
            sys.executable,
            __file__,
            "--checkpointing-child",
            mode,
            *(["--quick"] if args.quick else []),
        ]
        out = subprocess.run(command, capture_output=True, text=True, timeout=1200, check=True)
        memory[mode] = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_added_bytes"]
    data = checkpointing_batch(args.quick)
    times = time_layouts(
        "body",
        data,
        "cross_entropy",
        {
            mode: {"packing": False, "prefix_sharing": False, "checkpointing": mode}
            for mode in modes
        },
        args.repeats,
    )
    row: dict[str, Any] = {
        "model": "body",
        "tokens": sum(len(d.model_input.to_ints()) for d in data),
        "peak_rss_added_bytes": memory,
        "layouts": times,
    }
    for mode in ("selective", "full"):
        row[mode] = {
            "activation_memory_saved": 1 - memory[mode] / memory["none"],
            "compute_added": times[mode]["fastest_s"] / times["none"]["fastest_s"] - 1,
        }
        print(
            f"activation checkpointing {mode}: "
            f"{row[mode]['activation_memory_saved']:.0%} of the step's peak memory saved, "
            f"{row[mode]['compute_added']:+.0%} step time",
            flush=True,
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed repeats; ratios use the fastest"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small batches (a smoke run, not the reported figures)"
    )
    parser.add_argument(
        "--checkpointing-child", choices=["none", "selective", "full"], help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.checkpointing_child:
        checkpointing_child(args.checkpointing_child, args.quick)
        return
    rng = np.random.default_rng(0)
    result = {
        "benchmark": "prefix_sharing",
        "quick": args.quick,
        "repeats": args.repeats,
        "models": MODELS,
        "prefix_sharing": prefix_sharing_section(args, rng),
        "packing": packing_section(args, rng),
        "activation_checkpointing": checkpointing_section(args),
        "machine": common.machine(),
    }
    args.smollm2 = False
    path = common.write("prefix_sharing" + ("_quick" if args.quick else ""), args, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
