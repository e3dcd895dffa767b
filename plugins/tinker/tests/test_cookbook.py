"""Unmodified tinker-cookbook 0.5.8 recipes against `plait serve tinker`, given only the base URL,
an API key and their own command-line arguments: chat_sl lowers its loss, then math_rl
(env=arithmetic, importance_sampling) started from that state raises its reward.

tiny-qwen3 starts random (a random policy never ends its answer, so every RL group would score
alike and nothing would be learnt): the supervised recipe first teaches it the arithmetic
conversation format, on generated conversations shaped like the environment's prompts. The
recipes run in their own venv (scripts/ci/cookbook.sh: the cookbook pins transformers)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from plait.api import ResolvedModel
from plait_testing.venvs import venv_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
ROOT = Path(__file__).parents[3]


def arithmetic_conversations(path: Path, count: int = 640) -> None:
    """The environment's shape: a worked example, then "What is x + y?" answered by the sum."""
    rng = random.Random(0)
    with path.open("w") as out:
        for _ in range(count):
            x, y = rng.randint(0, 100), rng.randint(0, 100)
            out.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": "What is 4 + 5?"},
                            {"role": "assistant", "content": "9"},
                            {"role": "user", "content": f"What is {x} + {y}?"},
                            {"role": "assistant", "content": str(x + y)},
                        ]
                    }
                )
                + "\n"
            )


def metrics(log_path: Path, key: str) -> list[float]:
    rows = [
        json.loads(line)
        for line in (log_path / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return [row[key] for row in rows if key in row]


def test_cookbook_recipes_learn_against_the_server(
    tiny_qwen3: ResolvedModel, tmp_path: Path
) -> None:
    cookbook = venv_python(
        "PLAIT_COOKBOOK_VENV", ROOT / ".venvs" / "cookbook", "bash scripts/ci/cookbook.sh"
    )
    model = str(tiny_qwen3.path)
    config = tmp_path / "tinker.toml"
    config.write_text(
        f'[server]\nport = 0\nstorage = "{tmp_path / "storage"}"\n\n'
        f'[models."{model}"]\nmodel = "{model}"\n'
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "plait.cli", "serve", "tinker", str(config)],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "server.log").open("w"),
        text=True,
    )
    try:
        url = server.stdout.readline().split(" on ", 1)[1].split()[0]  # type: ignore[union-attr]
        env = {
            **os.environ,
            "TINKER_API_KEY": "tml-local",
            "HF_HUB_OFFLINE": "1",
            "TINKER_TELEMETRY": "0",
        }
        common = [
            f"model_name={model}",
            "renderer_name=qwen3",
            "lora_rank=8",
            f"base_url={url}",
            "eval_every=0",
            "behavior_if_log_dir_exists=delete",
        ]

        arithmetic_conversations(tmp_path / "arith.jsonl")
        supervised = subprocess.run(
            [
                cookbook,
                "-m",
                "tinker_cookbook.recipes.chat_sl.train",
                *common,
                f"dataset={tmp_path / 'arith.jsonl'}",
                "batch_size=32",
                "max_steps=6",
                "learning_rate=5e-3",
                "lr_schedule=constant",
                "max_length=256",
                "train_on_what=last_assistant_message",
                "save_every=0",
                f"log_path={tmp_path / 'sl'}",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert supervised.returncode == 0, supervised.stderr[-3000:]
        nll = metrics(tmp_path / "sl", "train_mean_nll")
        print("chat_sl train_mean_nll by step:", [round(v, 3) for v in nll])
        assert len(nll) == 6 and nll[-1] < nll[0] - 2.0, nll

        state = json.loads((tmp_path / "sl" / "checkpoints.jsonl").read_text().splitlines()[-1])[
            "state_path"
        ]
        reinforced = subprocess.run(
            [
                cookbook,
                "-m",
                "tinker_cookbook.recipes.math_rl.train",
                *common,
                "env=arithmetic",
                "loss_fn=importance_sampling",
                "group_size=8",
                "groups_per_batch=16",
                "max_steps=12",
                "learning_rate=2e-3",
                f"load_checkpoint_path={state}",
                "save_every=5",
                f"log_path={tmp_path / 'rl'}",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert reinforced.returncode == 0, reinforced.stderr[-3000:]
        reward = metrics(tmp_path / "rl", "env/all/reward/total")
        print("math_rl env/all/reward/total by step:", [round(v, 4) for v in reward])
        print(
            "math_rl env/all/format by step:",
            [round(v, 3) for v in metrics(tmp_path / "rl", "env/all/format")],
        )
        assert len(reward) == 12 and sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.02, reward
    finally:
        server.terminate()
        server.wait(60)
