"""The test-sized example learns with a KL penalty to the initial policy (`[rl.kl]`) whose
reference the trainer keeps (`trainer.options.reference`), and the penalty holds the policy near
it: in the loss, and taken off the rewards before the advantages.

Measured (seeded, 25 steps, 2 CPU cores, ~20 s each): in the loss, with coef 0.2 (k3) the best
10-step mean reward is 0.904 and held-out accuracy 0 -> 1.0, and policy/kl_ref is 0 at step 1 and
at most 2.22 (median 1.17); with coef 0.01 it reaches 5.04 (step 22), with 1.0 the run no longer
learns in 25 steps (reward 0.36). In the reward, with coef 0.2: best 10-step mean 0.957,
held-out 0 -> 1.0 -> 0.84, policy/kl_ref median 1.30 but single steps at 5.6, 6.6 and 11.1: steps
that keep only a few groups (84-132 action tokens), where one sample the reference finds unlikely
dominates the mean; and a group's shared part of the penalty is lost to its baseline. The bound
is on every step in the loss and on the median in the reward."""

from __future__ import annotations

import statistics

import pytest

pytestmark = pytest.mark.slow

KL_BOUND = 3.5


@pytest.mark.timeout(2400)  # the first run also builds tiny-qwen3-arith (minutes)
@pytest.mark.parametrize(
    "where, reference", [("loss", "trainer"), ("reward", "trainer"), ("loss", "inference")]
)
def test_tiny_model_learns_arith_near_its_reference(
    run_arith_tiny, where: str, reference: str
) -> None:
    kl_table = f"rl.kl={{coef=0.2, estimator='k3', where='{where}', reference='{reference}'}}"
    keeps = reference == "trainer"  # else a frozen plait-torch inference engine scores episodes
    run = run_arith_tiny(kl_table, f"trainer.options.reference={str(keeps).lower()}")
    run.assert_learned()
    kl = [m["policy/kl_ref"] for m in run.metrics if "policy/kl_ref" in m]
    assert len(kl) >= run.steps - 3, "steps with an update report kl_ref"
    assert kl[0] == pytest.approx(0.0, abs=1e-5), "the first step's policy is the reference"
    penalty = "optim/kl_penalty" if where == "loss" else "data/kl_reward_penalty"
    assert all(m[penalty] > 0 for m in run.metrics if m.get("policy/kl_ref", 0) > 0)
    assert max(kl) > 0.1, f"the policy never moved from its reference: {kl}"
    held = max(kl) if where == "loss" else statistics.median(kl)
    assert held < KL_BOUND, f"kl_ref {held:.3f} >= {KL_BOUND}: {kl}"
