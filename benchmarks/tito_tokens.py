"""Trained tokens of a multi-turn episode: one merged datum (TITO bridge) against one datum per
turn.

The same episodes are run twice with the reference inference engine (plait-torch) on the
calculator environment (plait-math): once with `qwen3_keep_reasoning`, which bridges every turn
(one datum per episode), and once with `qwen3`, whose official template rewrites history (every turn
re-rendered: one datum per turn, each repeating the whole conversation so far). The model is
tiny-qwen3 scripted to call the calculator on every turn (`plait_testing.scripted`), so an episode
lasts exactly `max_turns` turns; token counts do not depend on the model's quality.

Reported per number of turns T (1, 2, 4, 8): datums, trained tokens (positions the trainer runs a
forward/backward over: the sum of datum lengths), action tokens, and the split/merged ratio (O(T^2)
against O(T) in the turns). Writes benchmarks/results/tito_tokens.json.

    python benchmarks/tito_tokens.py [--turns 1 2 4 8]
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

from plait.models import ResolvedModel
from plait.plugins import get_registry
from plait.rollout import EpisodeConfig, run_episode
from plait.trajectory import Trajectory
from plait.types import Datum, SamplingParams
from plait_algorithms.datums import trajectory_to_datums
from plait_hf.chat_template import load_tokenizer
from plait_testing.scripted import build_scripted_qwen3, script_tokens

ROOT = Path(__file__).resolve().parents[1]
TOOL_CALL = (
    '<think>\n\n</think>\n\n\n<tool_call>{"name":"calculator","arguments":{"expression":"7*6"}}'
    "</tool_call><|im_end|>"
)
NEWLINE = 198  # the last token of every Qwen generation prompt
RENDERERS = {"merged": "qwen3_keep_reasoning", "split": "qwen3"}


def scripted_model(root: Path) -> ResolvedModel:
    from plait_torch.models import build_tiny_qwen3

    build_tiny_qwen3(root / "tiny-qwen3")
    script = script_tokens(load_tokenizer(root / "tiny-qwen3"), TOOL_CALL, avoid=[NEWLINE])
    build_scripted_qwen3(root / "tiny-qwen3", root / "scripted", NEWLINE, script)
    return ResolvedModel("scripted-tiny-qwen3", root / "scripted", root / "scripted")


async def episode(model: ResolvedModel, engine: Any, renderer_name: str, turns: int) -> Trajectory:
    registry = get_registry()
    renderer = registry.get("renderer", renderer_name).load()(model, options=None)
    factory = registry.get("env", "math.calculator")
    env = factory.load()(options=factory.options_class()())
    config = EpisodeConfig(SamplingParams(max_tokens=48, temperature=0.0), max_turns=turns)
    trajectory = await run_episode(env, await env.get_task("train", 0), engine, renderer, config)
    if trajectory.error is not None or trajectory.num_turns != turns:
        raise RuntimeError(
            f"the episode did not run {turns} turns: {trajectory.error or trajectory.num_turns}"
        )
    return trajectory


def counts(datums: list[Datum]) -> dict[str, int]:
    return {
        "datums": len(datums),
        "trained_tokens": sum(d.model_input.length for d in datums),
        "action_tokens": int(sum(d.loss_fn_inputs["mask"].to_numpy().sum() for d in datums)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "tito_tokens.json"
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    with tempfile.TemporaryDirectory() as tmp:
        model = scripted_model(Path(tmp))
        engine = get_registry().get("inference_engine", "torch").load()(model, options=None, seed=0)
        by_turns: dict[str, Any] = {}
        for turns in args.turns:
            row: dict[str, Any] = {}
            for label, renderer_name in RENDERERS.items():
                trajectory = asyncio.run(episode(model, engine, renderer_name, turns))
                datums = trajectory_to_datums(trajectory, advantage=1.0)
                row[label] = {**counts(datums), "bridged_turns": trajectory.bridged_turns}
            row["trained_tokens_ratio_split_over_merged"] = round(
                row["split"]["trained_tokens"] / row["merged"]["trained_tokens"], 3
            )
            by_turns[str(turns)] = row
            print(turns, row, flush=True)
        asyncio.run(engine.close())

    result = {
        "benchmark": "tito_tokens",
        "what": "trained tokens of one calculator episode of T turns: "
        "merged (bridged, one datum) vs "
        "split (official Qwen3 template re-rendered, one datum per turn)",
        "model": "tiny-qwen3 scripted to call the calculator every turn (plait_testing.scripted)",
        "renderers": RENDERERS,
        "by_turns": by_turns,
        "four_turn_episode": by_turns.get("4"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
