"""scripts/gpu/check.sh --dry-run: every part of the GPU check runs end to end on the CPU
(tiny-qwen3-8k's sizes, gloo for FSDP2, a random tiny-qwen3-8k for the GRPO run) and writes the JSON
that the real run writes on a lent GPU machine. A few minutes on 2 cores, hence slow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARTS = {"peak", "model", "trainer", "sampling", "fsdp2", "grpo", "pytest_gpu"}

pytestmark = pytest.mark.slow


def test_gpu_check_dry_run(tmp_path: Path) -> None:
    for module in ("plait_torch", "plait_fsdp2", "plait_math"):
        pytest.importorskip(module)
    check = REPO / "scripts" / "gpu" / "check.sh"
    done = subprocess.run(
        ["bash", str(check), "--dry-run", "--out", str(tmp_path), "--python", sys.executable],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    failed = {name: part.get("error") for name, part in result["parts"].items() if not part["ok"]}
    assert done.returncode == 0 and not failed, (failed, done.stdout[-4000:], done.stderr[-2000:])
    assert (tmp_path / "gpu_check.log").is_file()
    assert result["dry_run"] is True and result["ok"] is True
    assert set(result["parts"]) == PARTS  # every part ran: none is skipped on the CPU
    parts = result["parts"]
    assert parts["peak"]["measured_tflops"] > 0
    for workload in ("sft", "grpo"):
        assert parts["trainer"]["workloads"][workload]["mfu"] > 0
    assert parts["sampling"]["tokens_per_s"] > 0
    assert parts["sampling"]["logprob_vs_forward"]["mean_abs_difference"] < 0.05
    assert parts["fsdp2"]["backend"] == "gloo"
    assert parts["fsdp2"]["first_loss_vs_plait_torch"]["relative_difference"] < 1e-2
    assert parts["grpo"]["steps"] == 2
    assert parts["pytest_gpu"]["files"], "no test file uses the gpu marker"
    assert parts["pytest_gpu"]["counts"].get("skipped", 0) > 0  # no CUDA: the gpu tests skip
