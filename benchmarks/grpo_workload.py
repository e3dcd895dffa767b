"""The GRPO step that benchmarks/vs_minimal.py and benchmarks/vs_trl.py time on every side: the
demo.

SmolLM2-135M-Instruct on `math.arith` preset `sums` (a + b of single digits after three worked
examples as chat turns, the bare number as the answer), 8 prompts x 8 samples, 8 new tokens,
temperature 1, GRPO advantages ((r - mean) / (std + eps) per group), on-policy policy gradient,
AdamW at 2e-5, gradient clipping at 1. `examples/arith_smollm2.toml` is the same run.

Every side gets the tasks from `write_tasks` (the chat messages and the expected answer, as
JSON), so the hand-written loop and TRL need no plait import to run them; the reward is the
strict check of `reward`: the reply, stripped, is the number and nothing else.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m-instruct"
GROUPS = 8  # prompts per step
GROUP_SIZE = 8  # samples per prompt
MAX_TOKENS = 8
TEMPERATURE = 1.0
LEARNING_RATE = 2e-5
GRAD_CLIP = 1.0
SEED = 0
ENV_OPTIONS = {"preset": "sums", "seed": SEED}


def reward(text: str, answer: str) -> float:
    """math.arith's strict `plain` check for whole-number answers (the only kind `sums` has)."""
    return float(text.strip() == answer)


def model_dir() -> Path:
    """SmolLM2's checkpoint directory (plait converts it from the bundled GGUF on first use)."""
    from plait.components import resolve_model

    return Path(resolve_model(MODEL).path)


def write_tasks(path: Path, count: int, split: str = "train") -> Path:
    """`count` tasks of `split` as JSON lines: {"messages": [{"role", "content"}...], "answer"}."""
    from plait_math.arith import ArithOptions, make_env

    env = make_env(options=ArithOptions(**ENV_OPTIONS))

    async def tasks() -> list[dict[str, Any]]:
        rows = []
        for index in range(count):
            task = await env.get_task(split, index)
            session = await env.open(task)
            messages = await session.messages()
            await session.close()
            rows.append(
                {
                    "messages": [{"role": m.role, "content": m.content} for m in messages],
                    "answer": task["answer"],
                }
            )
        return rows

    path.write_text("".join(json.dumps(row) + "\n" for row in asyncio.run(tasks())))
    return path


def plait_config(out_dir: Path, name: str, steps: int) -> str:
    """plait's side: the run config (TOML) of the same step, without evaluation."""
    return f"""
[run]
name = "{name}"
seed = {SEED}
out_dir = "{out_dir}"

[model]
name = "{MODEL}"

[trainer]
engine = "torch"
learning_rate = {LEARNING_RATE}
grad_clip_norm = {GRAD_CLIP}

[inference]
engine = "torch"

[env]
name = "math.arith"
options = {{ preset = "{ENV_OPTIONS["preset"]}", seed = {SEED} }}

[rl]
steps = {steps}
groups_per_batch = {GROUPS}
group_size = {GROUP_SIZE}
max_tokens = {MAX_TOKENS}
temperature = {TEMPERATURE}
loss = "importance_sampling"
advantage = "grpo"

[eval]
every = 0  # before and after training only: the timed steps evaluate nothing
tasks = 8
samples_per_task = 1

[checkpoint]
every = 0

[metrics]
sinks = ["jsonl"]
"""


def plait_command(config: Path, threads: int | None, overrides: Sequence[str] = ()) -> list[str]:
    """`plait run` of this venv on `config` from scratch, with both engines on `threads` torch
    threads when given, and `overrides` (KEY=VALUE) applied."""
    command = [str(Path(sys.executable).parent / "plait"), "run", str(config), "--no-resume"]
    if threads:
        command += [
            "-s",
            f"trainer.options.threads={threads}",
            "-s",
            f"inference.options.threads={threads}",
        ]
    for override in overrides:
        command += ["-s", override]
    return command


def plait_steps(run_dir: Path, steps: int) -> list[dict[str, Any]]:
    """The training steps' rows of a finished run's metrics.jsonl, in order (the evaluation rows
    left out); raises unless there are `steps` of them."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = sorted((r for r in rows if "time/total" in r), key=lambda r: r["step"])
    if len(trained) != steps:
        raise SystemExit(
            f"plait logged {len(trained)} training steps in {run_dir}, expected {steps}"
        )
    return trained
