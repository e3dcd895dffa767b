"""Several policies in one run (examples/propose_solve_tiny.toml): a proposer and a solver, each
trained on its own role's turns and rewards with its own trainer, engine and weight sync; and the
same environment in self-play (one policy plays both roles) by config alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
PROPOSE_SOLVE = REPO / "examples" / "propose_solve_tiny.toml"
POLICIES = ("proposer", "solver")


def best_window(values: list[float], width: int = 10) -> float:
    return max(sum(values[i : i + width]) / width for i in range(len(values) - width + 1))


@pytest.mark.slow
def test_a_proposer_and_a_solver_both_learn_as_two_policies(run_arith_tiny: Any) -> None:
    """Both start low (the model rarely writes either part in the form the environment takes)
    and both rise; the proposer, rewarded only for problems the solver solves, depends on it."""
    run = run_arith_tiny(config=PROPOSE_SOLVE, steps=30)
    steps = [m for m in run.metrics if "time/total" in m]
    assert len(steps) == 30
    for policy in POLICIES:
        rewards = [m[f"reward/mean@{policy}"] for m in steps]
        first, best = sum(rewards[:3]) / 3, best_window(rewards)
        # measured over the example's 40 steps: proposer 0.03 -> best 10-step mean 0.50,
        # solver 0.25 -> 0.92
        assert first < 0.35 and best >= first + 0.3, (
            f"{policy}: first steps {rewards[:3]}, best {best:.2f}; {rewards}"
        )
        for key in ("optim/grad_norm", "policy/entropy", "sync/bytes", "data/datums"):
            assert f"{key}@{policy}" in steps[-1], key
        assert list((run.run_dir / "checkpoints").glob(f"step_*/trainer-{policy}")), policy
    evals = [m for m in run.metrics if "eval/reward@proposer" in m]  # greedy: 0.05 -> 0.63 measured
    assert (
        len(evals) == 3
        and evals[-1]["eval/reward@proposer"] >= evals[0]["eval/reward@proposer"] + 0.25
    )
    assert (run.run_dir / "dashboard.png").stat().st_size > 0
    sample = json.loads((run.run_dir / "samples.jsonl").read_text().splitlines()[-1])
    assert sample["roles"][0] == "proposer" and set(sample["role_rewards"]) <= set(POLICIES)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_self_play_is_the_same_config_without_policies(run_arith_tiny: Any, schedule: str) -> None:
    run = run_arith_tiny(
        "policies={}",
        f"rl.schedule={schedule}",
        "rl.groups_per_batch=4",
        "eval.every=0",
        "eval.tasks=4",
        config=PROPOSE_SOLVE,
        steps=3,
    )
    last = run.metrics[-1]
    assert not any(key.endswith(("@proposer", "@solver", "@policy")) for key in last), (
        "one policy: no policy names"
    )
    assert {"role/proposer/reward", "role/solver/reward"} <= set(last)
    checkpoint = sorted((run.run_dir / "checkpoints").glob("step_*"))[-1]
    assert (checkpoint / "trainer").is_dir()
    roles = {
        role
        for line in (run.run_dir / "samples.jsonl").read_text().splitlines()
        for role in json.loads(line).get("roles", [])
    }
    assert roles == set(POLICIES)  # one policy played both


def test_the_example_config_is_valid(tmp_path: Path) -> None:
    pytest.importorskip("plait_torch")
    pytest.importorskip("plait_math")
    from plait.components import validate_components
    from plait.config import load_config

    config = load_config(PROPOSE_SOLVE)
    validate_components(config)
    assert {name: p.roles for name, p in config.policies.items()} == {
        "proposer": ["proposer"],
        "solver": ["solver"],
    }
    assert config.policies["solver"].model == config.model
