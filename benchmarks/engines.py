"""Sampling throughput through plait-vllm, against vLLM's own offline `LLM.generate` and against
plait-torch, on the same model and prompts, in one run.

Every side samples the same P prompts, n samples each, to a fixed length (no early stop),
temperature 1, with the sampled tokens' logprobs (what RL needs):

- "vllm offline": `vllm.LLM.generate` on token prompts, in the vLLM venv (a subprocess; its
  engine in-process, no HTTP);
- "plait-vllm": `VLLMEngine.sample(prompt, n)` for the P prompts concurrently, against the vLLM
  server the engine launched (same vLLM, same dtype and settings);
- "plait-torch": plait-torch's in-process engine.

The sides run one after the other (the machine has two cores). Each does a warm-up, then
--repeats timed runs; medians and the ratios of the medians are reported:
plait-vllm / vllm offline is the plugin's overhead (HTTP, JSON, the server's API layer);
plait-vllm / plait-torch is what the vLLM engine gives over the reference engine.

    python benchmarks/engines.py                # tiny Qwen3, results/engines.json
    python benchmarks/engines.py --smollm2      # SmolLM2-135M
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import engine_bench as common
import numpy as np

OFFLINE = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def main():
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=spec["max_model_len"],
              enforce_eager=True, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = SamplingParams(n=spec["samples"], max_tokens=spec["new_tokens"], ignore_eos=True,
                            temperature=1.0, logprobs=0, seed=0, detokenize=False)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    seconds, tokens = [], []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        tokens.append(sum(len(c.token_ids) for o in outputs for c in o.outputs))
    print("RESULT " + json.dumps({"seconds": seconds, "tokens": tokens}))

if __name__ == "__main__":
    main()
"""


def vllm_python(args: argparse.Namespace) -> str:
    python = args.vllm_python or str(common.vllm_venv() / "bin" / "python")
    if not Path(python).is_file():
        raise SystemExit(
            f"no vLLM interpreter at {python}: run scripts/ci/vllm.sh or pass --vllm-python"
        )
    return python


def run_offline(python: str, spec: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "offline.py").write_text(OFFLINE)
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(spec["kv_cache_gib"]), "PYTHONPATH": ""}
        done = subprocess.run(
            [python, str(Path(tmp) / "offline.py"), str(Path(tmp) / "spec.json")],
            capture_output=True,
            text=True,
            env=env,
            timeout=3600,
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"vLLM offline run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def summarize(seconds: list[float], tokens: list[int]) -> dict:
    rates = [t / s for t, s in zip(tokens, seconds, strict=True)]
    return {
        "tokens_per_s_median": common.median(rates),
        "tokens_per_s": rates,
        "seconds": seconds,
        "tokens_per_run": tokens[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.model_arguments(parser)
    parser.set_defaults(repeats=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (n)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument(
        "--vllm-python", default=None, help="python of the vLLM venv (default $PLAIT_VLLM_VENV)"
    )
    args = parser.parse_args()

    from plait.types import ModelInput, SamplingParams
    from plait_server.engine import model_vocab_size

    model = common.resolve(args)
    python = vllm_python(args)
    vocab = min(model_vocab_size(model), 151643)  # real tokens only (Qwen3 pads its embedding)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, size=args.prompt_len).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, stop=[], temperature=1.0, seed=0)
    spec = {
        "model": str(model.path),
        "prompts": prompts,
        "samples": args.samples,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "max_model_len": args.max_model_len,
        "kv_cache_gib": args.kv_cache_gib,
    }

    print("vllm offline ...", flush=True)
    offline = summarize(**run_offline(python, spec))

    async def through(engine) -> tuple[list[float], list[int]]:
        async def once() -> int:
            responses = await asyncio.gather(
                *[engine.sample(ModelInput.from_ints(p), args.samples, params) for p in prompts]
            )
            return sum(len(s.tokens) for r in responses for s in r.sequences)

        await engine.sample(
            ModelInput.from_ints(prompts[0]), 1, params
        )  # warm-up (and server start)
        seconds, tokens = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens.append(await once())
            seconds.append(time.perf_counter() - start)
        return seconds, tokens

    print("plait-vllm ...", flush=True)
    from plait_vllm.engine import VLLMEngine
    from plait_vllm.options import VLLMOptions

    async def plait_vllm() -> tuple[list[float], list[int]]:
        engine = VLLMEngine(
            model,
            options=VLLMOptions(
                python=python,
                dtype="float32",
                max_model_len=args.max_model_len,
                kv_cache_gib=args.kv_cache_gib,
            ),
            seed=0,
        )
        try:
            return await through(engine)
        finally:
            await engine.close()

    served = summarize(*asyncio.run(plait_vllm()))

    print("plait-torch ...", flush=True)
    from plait_torch.inference import TorchInferenceEngine
    from plait_torch.options import TorchInferenceOptions

    async def plait_torch() -> tuple[list[float], list[int]]:
        engine = TorchInferenceEngine(
            model,
            options=TorchInferenceOptions(
                threads=args.threads, max_batch_size=args.prompts * args.samples
            ),
            seed=0,
        )
        try:
            return await through(engine)
        finally:
            await engine.close()

    torch_side = summarize(*asyncio.run(plait_torch()))

    result = {
        "benchmark": "engines",
        "model": model.name,
        "machine": common.machine(),
        "workload": {
            "prompts": args.prompts,
            "samples_per_prompt": args.samples,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "temperature": 1.0,
            "logprobs": "sampled token",
            "dtype": "float32",
            "repeats": args.repeats,
        },
        "vllm_offline": offline,
        "plait_vllm": served,
        "plait_torch": torch_side,
        "ratio_plait_vllm_over_vllm_offline": served["tokens_per_s_median"]
        / offline["tokens_per_s_median"],
        "ratio_plait_vllm_over_plait_torch": served["tokens_per_s_median"]
        / torch_side["tokens_per_s_median"],
    }
    path = common.write("engines", args, result)
    print(json.dumps({k: v for k, v in result.items() if k.startswith("ratio")}, indent=2))
    for side in ("vllm_offline", "plait_vllm", "plait_torch"):
        print(f"{side:14s} {result[side]['tokens_per_s_median']:8.1f} tokens/s")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
