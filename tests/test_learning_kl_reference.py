"""The test-sized example learns with a KL penalty to the initial policy (`[rl.kl]`) whose
ref_logprobs the trainer supplies itself (`trainer.options.reference`), and the penalty holds the
policy near it.

Measured (seeded, 25 steps, 2 CPU cores, ~20 s): with coef 0.2 (k3) the best 10-step mean
reward is 0.904 and held-out accuracy 0 -> 1.0, and policy/kl_ref is 0 at step 1 and at most 2.19;
with coef 0.01 it reaches 5.04 (step 22), with 1.0 the run no longer learns in 25 steps
(reward 0.36)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

KL_BOUND = 3.5


@pytest.mark.timeout(2400)  # the first run also builds tiny-qwen3-arith (minutes)
def test_tiny_model_learns_arith_near_its_reference(run_arith_tiny) -> None:
    run = run_arith_tiny("rl.kl={coef=0.2, estimator='k3'}", "trainer.options.reference=true")
    run.assert_learned()
    kl = [m["policy/kl_ref"] for m in run.metrics if "policy/kl_ref" in m]
    assert len(kl) >= run.steps - 3, "steps with an update report kl_ref"
    assert kl[0] == pytest.approx(0.0, abs=1e-6), "the first step's policy is the reference"
    assert all(m["optim/kl_penalty"] > 0 for m in run.metrics if m.get("policy/kl_ref", 0) > 0)
    assert max(kl) > 0.1, f"the policy never moved from its reference: {kl}"
    assert max(kl) < KL_BOUND, f"kl_ref {max(kl):.3f} >= {KL_BOUND}: {kl}"
