"""The test-sized example learns with the FSDP2 trainer on 2 gloo ranks, as with plait-torch's:
`plait run examples/arith_tiny.toml -s trainer.engine=fsdp2` takes the tiny model's reward on
math.arith (tiny preset) from below 0.1 to at least 0.8, with plait-torch's inference engine and
weights synced from the ranks' bucketed export every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arith_tiny.toml"
STEPS = 30


@pytest.mark.timeout(1800)  # the first run also builds tiny-qwen3-arith (minutes)
def test_tiny_model_learns_arith_on_two_fsdp2_ranks(tmp_path: Path) -> None:
    for module in ("plait_torch", "plait_math", "plait_fsdp2"):
        pytest.importorskip(module)
    overrides = ["trainer.engine=fsdp2", "trainer.options.world_size=2", "trainer.options.device=cpu",
                 f"rl.steps={STEPS}", f"run.out_dir={tmp_path}"]
    run = subprocess.run([sys.executable, "-m", "plait.cli", "run", str(EXAMPLE), "--no-resume",
                          *(arg for o in overrides for arg in ("-s", o))],
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "fsdp2 trainer ready" in run.stdout + run.stderr, "the run must train on the fsdp2 engine"
    run_dir = tmp_path / "arith-tiny"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward/mean"] for m in metrics if "reward/mean" in m]
    assert len(rewards) == STEPS
    assert rewards[0] < 0.1, f"the task must start hard for the model: first-step reward {rewards[0]}"
    final = sum(rewards[-5:]) / 5
    assert final >= 0.8, f"reward over the last 5 steps {final:.2f} < 0.8; rewards: {rewards}"
