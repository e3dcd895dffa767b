"""The test-sized example learns with the FSDP2 trainer on 2 gloo ranks, as with plait-torch's:
`plait run examples/arith_tiny.toml -s trainer.engine=fsdp2` takes the tiny model's reward on
math.arith (tiny preset) from below 0.1 to at least 0.8, with plait-torch's inference engine and
weights synced from the ranks' bucketed export every step."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.timeout(2400)  # the first run also builds tiny-qwen3-arith (minutes)
def test_tiny_model_learns_arith_on_two_fsdp2_ranks(run_arith_tiny) -> None:
    pytest.importorskip("plait_fsdp2")
    run = run_arith_tiny(
        "trainer.engine=fsdp2", "trainer.options.world_size=2", "trainer.options.device=cpu"
    )
    assert "fsdp2 trainer ready" in run.output, "the run must train on the fsdp2 engine"
    run.assert_learned()
