"""A Bradley–Terry reward model grades an RL run, end to end: `plait reward-model train` fits
tiny-qwen3-arith with a value head to preference pairs on single-digit sums (the bare right
number preferred to the model's own sentence, "7 is the sum.", to other wordings or none, and to
a bare wrong number), then the test-sized example runs with the judge environment scoring every
episode by that model alone (env_weight 0), and a KL penalty to the starting policy. The
environment's own reward, which trains nothing here, and its held-out accuracy rise from below
0.1: the policy learnt the strict format from the reward model.

Measured (docs/algorithms.md): the reward model ranks 0.9 of its 60 held-out pairs right: all
42 against a wording, 12 of 16 against a wrong number, neither against no reply: it learnt the
format far better than the sums. Without the KL penalty the policy learns the format, then its
sums drift where the reward model cannot tell (the environment's reward peaked at 0.61 at step
14 and fell to 0.08 by step 25; held-out 0.34); with `rl.kl.coef = 0.5` it keeps them (best
10-step mean 0.75, held-out 0.84, policy/kl_ref about 0.55)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def write_pairs(path: Path, count: int, seed: int) -> None:
    """Sums "a + b =" with the bare right number chosen, and rejected: the model's own sentence,
    another wording or no reply, or a bare wrong number (a third each)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            right = a + b
            wrong = right + rng.choice([-3, -2, -1, 1, 2, 3])
            wrong = wrong if wrong >= 0 else right + 1
            rejected = rng.choice(
                [
                    f"{right} is the sum.",
                    rng.choice([f"The sum is {right}.", f"{right} is", f"{wrong} is the sum.", ""]),
                    str(wrong),
                ]
            )
            pair = {"prompt": f"{a} + {b} =", "chosen": str(right), "rejected": rejected}
            f.write(json.dumps(pair) + "\n")


@pytest.mark.timeout(2400)
def test_a_reward_model_with_a_kl_penalty_teaches_the_answer_format(
    tmp_path_factory: pytest.TempPathFactory, run_arith_tiny: Callable[..., object]
) -> None:
    pytest.importorskip("plait_algorithms")
    work = tmp_path_factory.mktemp("reward-model")
    write_pairs(work / "pairs.jsonl", 600, seed=0)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait.cli",
            "reward-model",
            "train",
            str(work / "pairs.jsonl"),
            "--model",
            "tiny-qwen3-arith",
            "--out",
            str(work / "rm"),
            "--steps",
            "100",
            "--learning-rate",
            "2e-3",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((work / "rm" / "reward_model.json").read_text())
    print(
        f"reward model: held-out pair accuracy {manifest['held_out_accuracy_before']} -> "
        f"{manifest['held_out_accuracy']}"
    )
    assert manifest["held_out_accuracy"] >= 0.7

    run = run_arith_tiny(
        "env.name=judge",
        f'env.options={{env="math.arith", env_options={{preset="tiny"}}, '
        f'reward_model="{work / "rm"}", env_weight=0.0, judge_weight=1.0}}',
        "rl.kl.coef=0.5",
        "trainer.options.reference=true",
    )
    env_rewards = [m["env/reward/env"] for m in run.metrics if "env/reward/env" in m]
    accuracy = [m["eval/accuracy"] for m in run.metrics if "eval/accuracy" in m]
    best = max(sum(env_rewards[i : i + 10]) / 10 for i in range(len(env_rewards) - 9))
    print(f"environment's reward {env_rewards}, held-out accuracy {accuracy}")
    assert env_rewards[0] < 0.1 and best >= 0.6
    assert accuracy[0] < 0.1 and max(accuracy[1:]) >= 0.6
