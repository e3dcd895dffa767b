"""Sampling throughput: plait-torch's inference engine vs Hugging Face `generate`, same run.

Both sample the same prompts to the same fixed length (no early stop) on the same weights and
threads, temperature 1 without top-k/top-p. Two workloads of P*n sequences each:

- groups: P prompts with n samples each (RL's shape). plait sends them as P requests for n
  samples ("plait_grouped") and as P*n one-sample requests ("plait_separate", what the
  controller's rollouts send); both prefill each distinct prompt once. HF `generate` gets the P
  prompts with num_return_sequences=n (it prefills every copy).
- distinct: P*n different prompts, one sample each: no prompt sharing, so this compares the
  decode loops alone.

Both run their compute in a worker thread. Repeats alternate between the sides; medians are
reported, and each side's ratio to HF.

    python benchmarks/sampling_throughput.py              # tiny Qwen3
    python benchmarks/sampling_throughput.py --smollm2    # SmolLM2-135M
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures

import engine_bench as common
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.model_arguments(parser)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (n)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from plait.types import ModelInput, SamplingParams
    from plait_torch.inference import TorchInferenceEngine
    from plait_torch.options import TorchInferenceOptions

    model = common.resolve(args)
    engine = TorchInferenceEngine(
        model,
        options=TorchInferenceOptions(
            threads=args.threads, max_batch_size=args.prompts * args.samples
        ),
    )
    hf = AutoModelForCausalLM.from_pretrained(
        str(model.path), local_files_only=True, dtype=torch.float32
    ).eval()
    vocab = min(engine.vocab_rows, len(engine.tokenizer))
    rng = np.random.default_rng(0)
    rows = args.prompts * args.samples
    prompts = rng.integers(0, vocab, size=(args.prompts, args.prompt_len)).tolist()
    distinct = rng.integers(0, vocab, size=(rows, args.prompt_len)).tolist()
    params = SamplingParams(max_tokens=args.new_tokens, stop=[], temperature=1.0)
    expected_tokens = rows * args.new_tokens

    async def plait_requests(requests: list[tuple[list[int], int]]) -> int:
        responses = await asyncio.gather(
            *[engine.sample(ModelInput.from_ints(p), n, params) for p, n in requests]
        )
        return sum(len(s.tokens) for r in responses for s in r.sequences)

    eos = hf.generation_config.eos_token_id

    worker = concurrent.futures.ThreadPoolExecutor(1)

    def hf_generate(batch: list[list[int]], n: int) -> int:
        # In a worker thread, like the engine's compute: torch's threading behaves differently
        # in the main thread (on a busy 2-core machine, 3x slower), which would skew the ratio.
        return worker.submit(hf_generate_here, batch, n).result()

    def hf_generate_here(batch: list[list[int]], n: int) -> int:
        input_ids = torch.tensor(batch)  # same length: no padding needed
        with torch.inference_mode():
            out = hf.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                num_return_sequences=n,
                pad_token_id=eos if isinstance(eos, int) else 0,
                use_cache=True,
            )
        return int(out[:, input_ids.shape[1] :].numel())

    sides = {
        "groups/plait_grouped": lambda: asyncio.run(
            plait_requests([(p, args.samples) for p in prompts])
        ),
        "groups/plait_separate": lambda: asyncio.run(
            plait_requests([(p, 1) for p in prompts for _ in range(args.samples)])
        ),
        "groups/hf_generate": lambda: hf_generate(prompts, args.samples),
        "distinct/plait": lambda: asyncio.run(plait_requests([(p, 1) for p in distinct])),
        "distinct/hf_generate": lambda: hf_generate(distinct, 1),
    }
    for run in sides.values():  # warm-up
        assert run() == expected_tokens
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, run in sides.items():
            elapsed, tokens = common.timed(run)
            assert tokens == expected_tokens
            seconds[name].append(elapsed)

    tokens_per_s = {name: expected_tokens / common.median(s) for name, s in seconds.items()}
    ratios = {
        name: value / tokens_per_s[name.split("/")[0] + "/hf_generate"]
        for name, value in tokens_per_s.items()
        if not name.endswith("hf_generate")
    }
    result = {
        "benchmark": "sampling_throughput",
        "model": model.name,
        "prompts": args.prompts,
        "samples_per_prompt": args.samples,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "tokens_per_run": expected_tokens,
        "repeats": args.repeats,
        "seconds": seconds,
        "tokens_per_s": tokens_per_s,
        "ratio_vs_hf_generate": ratios,
        "machine": common.machine(),
    }
    path = common.write("sampling_throughput", args, result)
    print(
        f"{model.name}: {rows} sequences x {args.new_tokens} new tokens "
        f"after {args.prompt_len}-token prompts (medians of {args.repeats}):"
    )
    for name, value in tokens_per_s.items():
        ratio = f"  {ratios[name]:.2f}x HF generate" if name in ratios else ""
        print(f"  {name:22s} {value:8.1f} tokens/s{ratio}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
