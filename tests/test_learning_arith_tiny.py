"""The test-sized example learns: `plait run examples/arith_tiny.toml` takes the tiny model's
reward on math.arith (tiny preset) from below 0.1 to at least 0.8, and its held-out greedy
accuracy rises with it — with the reference engines, and with a real vLLM server sampling
(`inference.engine = "vllm"`, weights synced to it every step). CI runs both (marked slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "arith_tiny.toml"


def vllm_overrides() -> list[str]:
    pytest.importorskip("plait_vllm")
    python = Path(os.environ.get("PLAIT_VLLM_VENV") or REPO / ".venvs" / "vllm") / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"no vLLM venv at {python.parent.parent}: run scripts/ci/vllm.sh")
    # float32 like the trainer, so that the sampler's logprobs are the trainer's
    return ["inference.engine=vllm", f"inference.options.python={python}", "inference.options.dtype=float32",
            "inference.options.max_model_len=512"]


@pytest.mark.parametrize("engine", ["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_tiny_model_learns_arith(tmp_path: Path, engine: str) -> None:
    pytest.importorskip("plait_torch")
    pytest.importorskip("plait_math")
    overrides = [f"run.out_dir={tmp_path}", *(vllm_overrides() if engine == "vllm" else [])]
    run = subprocess.run([sys.executable, "-m", "plait.cli", "run", str(EXAMPLE), "--no-resume",
                          *[arg for item in overrides for arg in ("-s", item)]],
                         capture_output=True, text=True, timeout=2400)
    assert run.returncode == 0, run.stderr[-3000:]
    run_dir = tmp_path / "arith-tiny"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward/mean"] for m in metrics if "reward/mean" in m]
    assert len(rewards) == 30
    assert rewards[0] < 0.1, f"the task must start hard for the model: first-step reward {rewards[0]}"
    final = sum(rewards[-5:]) / 5
    assert final >= 0.8, f"reward over the last 5 steps {final:.2f} < 0.8; rewards: {rewards}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_accuracy_start"] < 0.1 and summary["eval_accuracy_end"] >= 0.8, summary
    assert (run_dir / "dashboard.png").stat().st_size > 0
