"""Routing replay (R3) on a mixture of experts, end to end: `examples/arith_tiny_moe.toml`
(tiny-qwen3-moe-arith sampled in bfloat16 by plait-torch, which records every token's experts,
and trained in float32 with those experts forced) learns the test-sized arithmetic task, in the
sync and the async schedule. Every step's trainer used exactly the sampler's experts, while its
own routers would have chosen others for some tokens (the precision split makes them differ)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ARITH_TINY_MOE = Path(__file__).resolve().parents[1] / "examples" / "arith_tiny_moe.toml"


@pytest.mark.timeout(2400)  # the first run also builds tiny-qwen3-arith (minutes)
@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_moe_learns_arith_with_routing_replay(
    run_arith_tiny, run_arith_tiny_async, schedule: str
) -> None:
    if (
        schedule == "async"
    ):  # the async bar of the dense example (tests/test_async_rl.py): async runs learn slower
        run = run_arith_tiny_async(config=ARITH_TINY_MOE)
        run.assert_learned(min_reward=0.65, min_accuracy=0.6)
    else:
        run = run_arith_tiny(config=ARITH_TINY_MOE)
        run.assert_learned()
    trained = [m for m in run.metrics if "policy/routing_agreement" in m]  # steps that trained
    assert len(trained) >= run.steps // 2
    assert all(
        m["policy/routing_agreement"] == 1.0 for m in trained
    )  # measured on what the experts got
    assert (
        min(m["policy/routing_natural_agreement"] for m in trained) < 1.0
    )  # replay had work to do
    assert all(
        m["data/routing_bytes_per_token"] == 2 * 2 for m in trained
    )  # 2 layers x top-2, uint8
