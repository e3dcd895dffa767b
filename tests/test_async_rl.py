"""The async schedule end to end (plait-torch engines, math.arith): staleness stays within
`off_policy.max_staleness` under every pause mode, data is trained in the run's task order, and
the test-sized example (examples/arith_tiny.toml) still learns when run async."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("plait_torch", reason="needs the reference engines (plait-torch)")
pytest.importorskip("plait_math", reason="needs the arithmetic environment (plait-math)")

from plait.config import load_config
from plait.run.checkpoint import LEDGER_FILE
from plait.run.loop import run_training
from plait_testing.models import materialize_model

pytestmark = pytest.mark.slow

STEPS, GROUPS, GROUP_SIZE = 5, 2, 4


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialize_model("tiny-qwen3", tmp_path_factory.mktemp("models") / "tiny-qwen3").path


def metrics_of(run_dir: Path) -> list[dict[str, float]]:
    return [
        m
        for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if m["step"] > 0
    ]


@pytest.mark.parametrize(
    ("max_staleness", "pause"), [(0, "keep"), (2, "keep"), (1, "abort"), (1, "wait")]
)
def test_staleness_stays_within_its_bound(max_staleness, pause, tiny_qwen3, tmp_path):
    config = load_config(
        None,
        [
            f"run.out_dir={tmp_path}",
            "run.name=async",
            "run.log_level=warning",
            f"model.name={tiny_qwen3}",
            "trainer.engine=torch",
            "inference.engine=torch",
            "env.name=math.arith",
            "rl.schedule=async",
            f"rl.steps={STEPS}",
            f"rl.groups_per_batch={GROUPS}",
            f"rl.group_size={GROUP_SIZE}",
            "rl.max_tokens=12",
            f"off_policy.max_staleness={max_staleness}",
            f"off_policy.update_pause={pause}",
            "eval.every=0",
            "eval.tasks=1",
            "eval.samples_per_task=1",
            'metrics.sinks=["jsonl"]',
        ],
    )
    run_training(config, resume=False)
    run_dir = tmp_path / "async"
    steps = metrics_of(run_dir)
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for m in steps:
        assert 0 <= m["async/staleness_mean"] <= m["async/staleness_max"] <= max_staleness, m
        assert m["time/stall"] >= 0 and m["sync/bytes"] > 0
    if max_staleness == 2:  # batches 0-2 start together at version 0: batch 2 trains at version 2
        assert max(m["async/staleness_max"] for m in steps) > 0
    ledger = [json.loads(line) for line in (run_dir / LEDGER_FILE).read_text().splitlines()]
    for (
        record
    ) in ledger:  # step s trains the prompts at positions [(s-1)*GROUPS, s*GROUPS), whole groups
        assert sorted((p, i) for p, i, *_ in record["samples"]) == [
            (p, i)
            for p in range((record["step"] - 1) * GROUPS, record["step"] * GROUPS)
            for i in range(GROUP_SIZE)
        ]
        assert record["weight_version"] == ledger[0]["weight_version"] + record["step"] - 1


@pytest.mark.timeout(2400)  # the first run also builds tiny-qwen3-arith (minutes)
def test_arith_tiny_learns_async(run_arith_tiny_async):
    """examples/arith_tiny.toml with rl.schedule = "async" (staleness <= 2, token-level truncated
    IS, learning rate 1e-3: see tests/conftest.py) learns, and staleness and applied importance
    weights stay in bounds."""
    run = run_arith_tiny_async()
    run.assert_learned(min_reward=0.65, min_accuracy=0.6)
    steps = [m for m in run.metrics if m["step"] > 0 and "reward/mean" in m]
    for m in steps:
        assert m["async/staleness_max"] <= 2, m
        if "policy/is_weight_applied_max" in m:
            assert m["policy/is_weight_applied_max"] <= 2.0, m
    assert max(m["async/staleness_max"] for m in steps) > 0  # it did run off-policy
