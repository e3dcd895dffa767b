"""Sampling throughput: plait-torch's inference engine vs Hugging Face `generate`, same run.

Both sample the same prompts to the same fixed length (no early stop) on the same weights and
threads, temperature 1 without top-k/top-p. Two workloads:

- "grouped": P prompts, each one request for n samples (`sample(prompt, n)`);
- "separate": the same P*n samples as P*n concurrent one-sample requests, as the controller's
  rollouts send them (the engine batches them and prefills each distinct prompt once).

HF `generate` gets the P prompts left-padded with num_return_sequences=n. Repeats alternate
between the two sides; medians are reported, and the ratio of the medians.

    python benchmarks/sampling_throughput.py              # tiny Qwen3
    python benchmarks/sampling_throughput.py --smollm2    # SmolLM2-135M
"""

from __future__ import annotations

import argparse
import asyncio

import common
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
    engine = TorchInferenceEngine(model, options=TorchInferenceOptions(
        threads=args.threads, max_batch_size=args.prompts * args.samples))
    hf = AutoModelForCausalLM.from_pretrained(str(model.path), local_files_only=True, dtype=torch.float32).eval()
    vocab = min(engine.vocab_rows, len(engine.tokenizer))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, size=args.prompt_len).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, stop=[], temperature=1.0)
    expected_tokens = args.prompts * args.samples * args.new_tokens

    async def plait_grouped() -> int:
        responses = await asyncio.gather(*[engine.sample(ModelInput.from_ints(p), args.samples, params) for p in prompts])
        return sum(len(s.tokens) for r in responses for s in r.sequences)

    async def plait_separate() -> int:
        responses = await asyncio.gather(*[engine.sample(ModelInput.from_ints(p), 1, params)
                                           for p in prompts for _ in range(args.samples)])
        return sum(len(r.sequences[0].tokens) for r in responses)

    input_ids = torch.tensor(prompts)  # same length: no padding needed
    eos = hf.generation_config.eos_token_id

    def hf_generate() -> int:
        with torch.inference_mode():
            out = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              num_return_sequences=args.samples, pad_token_id=eos if isinstance(eos, int) else 0)
        return int(out[:, input_ids.shape[1]:].numel())

    sides = {
        "plait_grouped": lambda: asyncio.run(plait_grouped()),
        "plait_separate": lambda: asyncio.run(plait_separate()),
        "hf_generate": hf_generate,
    }
    for run in sides.values():  # warm-up (shorter would change nothing the timing needs)
        assert run() == expected_tokens
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, run in sides.items():
            elapsed, tokens = common.timed(run)
            assert tokens == expected_tokens
            seconds[name].append(elapsed)

    tokens_per_s = {name: expected_tokens / common.median(s) for name, s in seconds.items()}
    result = {
        "benchmark": "sampling_throughput", "model": model.name,
        "prompts": args.prompts, "samples_per_prompt": args.samples, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "tokens_per_run": expected_tokens, "repeats": args.repeats,
        "seconds": seconds, "tokens_per_s": tokens_per_s,
        "ratio_grouped_vs_hf": tokens_per_s["plait_grouped"] / tokens_per_s["hf_generate"],
        "ratio_separate_vs_hf": tokens_per_s["plait_separate"] / tokens_per_s["hf_generate"],
        "machine": common.machine(),
    }
    path = common.write("sampling_throughput", result)
    print(f"{model.name}, {args.prompts} prompts x {args.samples} samples x {args.new_tokens} tokens "
          f"(medians of {args.repeats}):")
    for name, value in tokens_per_s.items():
        print(f"  {name:15s} {value:8.1f} tokens/s  ({value / tokens_per_s['hf_generate']:.2f}x HF generate)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
