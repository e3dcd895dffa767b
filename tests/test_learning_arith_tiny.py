"""The test-sized example learns: `plait run examples/arith_tiny.toml` takes the tiny model's
reward on math.arith (tiny preset) from below 0.1 to at least 0.8, and its held-out greedy
accuracy rises with it — with the reference engines, and with a real vLLM server sampling
(`inference.engine = "vllm"`, weights synced to it every step). CI runs both (marked slow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait_testing.venvs import venv_python

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def vllm_overrides() -> list[str]:
    pytest.importorskip("plait_vllm")
    python = venv_python("PLAIT_VLLM_VENV", REPO / ".venvs" / "vllm", "scripts/ci/vllm.sh")
    # float32 like the trainer, so that the sampler's logprobs are the trainer's
    return ["inference.engine=vllm", f"inference.options.python={python}", "inference.options.dtype=float32",
            "inference.options.max_model_len=512"]


@pytest.mark.timeout(2400)  # the first run also builds tiny-qwen3-arith (minutes)
@pytest.mark.parametrize("engine", ["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_tiny_model_learns_arith(run_arith_tiny, engine: str) -> None:
    run = run_arith_tiny(*(vllm_overrides() if engine == "vllm" else []))
    run.assert_learned()
    assert (run.run_dir / "dashboard.png").stat().st_size > 0
