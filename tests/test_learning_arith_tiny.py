"""The test-sized example learns: `plait run examples/arith_tiny.toml` takes the tiny model's
reward on math.arith (tiny preset) from below 0.1 to at least 0.8 within 25 of its 60 steps, and
its held-out greedy accuracy rises with it — with the reference engines, with a real vLLM server
sampling (`inference.engine = "vllm"`, weights synced to it every step), and with every rollout
made by an unmodified openai-SDK client through plait-proxy (`proxy.harness`: the trainer sees
only what the proxy recorded). CI runs all three (marked slow)."""

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
    return [
        "inference.engine=vllm",
        f"inference.options.python={python}",
        "inference.options.dtype=float32",
        "inference.options.max_model_len=512",
    ]


def proxy_overrides() -> list[str]:
    pytest.importorskip("plait_proxy")
    pytest.importorskip("openai")
    return [
        "env.name=proxy.harness",
        'env.options={tasks="math.arith", task_options={preset="tiny"}, '
        'function="plait_proxy.agents:openai_chat"}',
    ]


OVERRIDES = {"torch": list, "vllm": vllm_overrides, "proxy": proxy_overrides}


@pytest.mark.timeout(2400)  # the first run also builds tiny-qwen3-arith (minutes)
@pytest.mark.parametrize(
    "variant", ["torch", pytest.param("vllm", marks=pytest.mark.vllm), "proxy"]
)
def test_tiny_model_learns_arith(run_arith_tiny, variant: str) -> None:
    run = run_arith_tiny(*OVERRIDES[variant]())
    run.assert_learned()
    assert (run.run_dir / "dashboard.png").stat().st_size > 0
