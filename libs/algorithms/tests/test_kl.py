"""KL to the reference policy in the reward (plait_algorithms.kl), reached as a run reaches it
(the run loop hands the batch preparer the policy's trainer): each sample's reward loses coef x
its summed per-token KL estimate before the estimator sees it; on a trainer whose estimates are
known (plait-torch's `kl_ref` output is tested there, against hand-written estimators)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import pytest

from plait.api import (
    ConfigError,
    DataError,
    Datum,
    EngineError,
    ForwardBackwardOutput,
    ModelInput,
    TensorData,
    load_config,
)
from plait.config import KLSection
from plait_algorithms import batch, kl
from plait_testing.trajectories import episode


class KnownKL:
    """A policy trainer whose KL estimate at a position is a hundredth of its target token; it
    records each forward call's data and loss config."""

    def __init__(self, output: str = "kl_ref") -> None:
        self.output = output
        self.calls: list[tuple[int, dict[str, float]]] = []

    def forward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> ForwardBackwardOutput:
        self.calls.append((len(data), dict(loss_fn_config or {})))
        outputs = []
        for d in data:
            targets = d.loss_fn_inputs["target_tokens"].to_numpy()
            outputs.append(
                {
                    "logprobs": TensorData.from_numpy(np.zeros(len(targets), np.float32)),
                    self.output: TensorData.from_numpy(0.01 * targets.astype(np.float32)),
                }
            )
        return ForwardBackwardOutput(loss_fn, outputs, {"loss:sum": 0.0})


def action_tokens(trajectory) -> np.ndarray:
    return np.asarray([t for turn in trajectory.turns for t in turn.completion.tokens])


def prepare(trainer: KnownKL, groups, *overrides: str) -> tuple[list[Datum], dict[str, float]]:
    config = load_config(
        None,
        [
            "rl.kl={coef=0.5, estimator='k1', where='reward'}",
            "rl.advantage=dr_grpo",
            "rl.loss_aggregation=sequence_sum",
            "rl.micro_batch_size=2",
            *overrides,
        ],
    )
    return batch.prepare(config, groups, trainer)


def test_each_samples_reward_loses_its_summed_kl_before_the_advantages():
    trainer = KnownKL()
    varied = [episode(1.0, [3, 2]), episode(0.0, [4], offset=1)]  # 5 and 4 action tokens
    constant = [episode(1.0, [2]), episode(1.0, [3], offset=2)]  # left out before the KL pass
    datums, metrics = prepare(trainer, [varied, constant])

    kl = [0.01 * action_tokens(t).sum() for t in varied]
    rewards = np.asarray([t.reward - 0.5 * k for t, k in zip(varied, kl, strict=True)])
    advantages = (rewards - rewards.mean()) / len(varied)  # dr_grpo, a sequence sum over 2
    placed = [d.loss_fn_inputs["advantages"].to_numpy() for d in datums]
    masks = [d.loss_fn_inputs["mask"].to_numpy() > 0 for d in datums]
    per_datum = [a[m] for a, m in zip(placed, masks, strict=True)]
    assert [len(a) for a in per_datum] == [3, 2, 4]  # two datums, then one
    np.testing.assert_allclose(np.concatenate(per_datum[:2]), advantages[0], rtol=1e-6)
    np.testing.assert_allclose(per_datum[2], advantages[1], rtol=1e-6)
    assert metrics["policy/kl_ref"] == pytest.approx(sum(kl) / 9)
    assert metrics["data/kl_reward_penalty"] == pytest.approx(0.25 * sum(kl))
    assert metrics["data/groups_constant"] == 1
    # the varied group's three datums, two a call, with the KL keys (k1 as its number)
    keys = {"kl_coef": 0.5, "kl_estimator": 1.0}
    assert trainer.calls == [(2, keys), (1, keys)]


def test_kl_in_the_loss_asks_the_preparer_for_nothing():
    trainer = KnownKL()
    groups = [[episode(1.0, [3]), episode(0.0, [2], offset=1)]]
    _, metrics = prepare(trainer, groups, "rl.kl.where=loss")
    assert trainer.calls == [] and "policy/kl_ref" not in metrics


def test_a_trainer_that_gives_no_kl_is_named_with_the_fix():
    groups = [[episode(1.0, [3]), episode(0.0, [2], offset=1)]]
    with pytest.raises(DataError, match="gives no 'kl_ref' output") as info:
        prepare(KnownKL(output="something_else"), groups)
    assert "trainer.options.reference = true" in str(info.value.fix)


# -- the reference on an inference engine (rl.kl.reference = "inference") --------------------


def with_refs(trajectory, ref: float):
    """`trajectory` with the reference logprob `ref` on every completion token."""
    turns = [
        attrs.evolve(t, ref_logprobs=(ref,) * len(t.completion.tokens)) for t in trajectory.turns
    ]
    return attrs.evolve(trajectory, turns=turns)


@pytest.mark.parametrize(
    "estimator, per_token",
    [  # the sampler's logprob is -0.5, the reference's -1.5: log r = 1
        ("k1", 1.0),
        ("k2", 0.5),
        ("k3", math.exp(-1.0) - 1.0 + 1.0),  # r' - 1 - log r' with r' = exp(ref - lp)
    ],
)
def test_in_the_reward_the_episodes_reference_logprobs_need_no_forward_pass(estimator, per_token):
    varied = [with_refs(episode(1.0, [3, 2]), -1.5), with_refs(episode(0.0, [4], offset=1), -1.5)]
    config = load_config(
        None,
        [
            f"rl.kl={{coef=0.5, estimator='{estimator}', where='reward', reference='inference'}}",
            "rl.advantage=dr_grpo",
            "rl.loss_aggregation=sequence_sum",
        ],
    )
    datums, metrics = batch.prepare(config, [varied])  # no trainer at all
    rewards = np.asarray([1.0 - 0.5 * 5 * per_token, 0.0 - 0.5 * 4 * per_token])
    advantages = (rewards - rewards.mean()) / 2
    placed = [d.loss_fn_inputs["advantages"].to_numpy() for d in datums]
    masks = [d.loss_fn_inputs["mask"].to_numpy() > 0 for d in datums]
    got = [a[m] for a, m in zip(placed, masks, strict=True)]
    np.testing.assert_allclose(np.concatenate(got[:2]), advantages[0], rtol=1e-6)
    np.testing.assert_allclose(got[2], advantages[1], rtol=1e-6)
    assert metrics["policy/kl_ref"] == pytest.approx(per_token)
    # spent on the rewards: the trainer's own estimate must not replace policy/kl_ref
    assert not any("ref_logprobs" in d.loss_fn_inputs for d in datums)


def test_the_estimators_match_their_formulas_on_fixed_values():
    lp, ref = np.asarray([-0.2, -1.0, -3.0]), np.asarray([-0.7, -1.0, -0.5])
    log_r = lp - ref
    np.testing.assert_allclose(kl.estimate(lp, ref, "k1"), log_r)
    np.testing.assert_allclose(kl.estimate(lp, ref, "k2"), [0.5 * x * x for x in log_r])
    k3 = [math.exp(r - p) - 1 - (r - p) for p, r in zip(lp, ref, strict=True)]
    np.testing.assert_allclose(kl.estimate(lp, ref, "k3"), k3)


def test_an_inference_reference_without_reference_logprobs_is_named_with_the_fix():
    groups = [[episode(1.0, [3]), episode(0.0, [2], offset=1)]]
    config = load_config(None, ["rl.kl={coef=0.1, reference='inference'}"])
    with pytest.raises(DataError, match="came without the reference's logprobs") as info:
        batch.prepare(config, groups)
    assert "rl.kl.reference = 'trainer'" in str(info.value.fix)


def test_the_trainers_reference_without_a_trainer_is_a_config_error():
    groups = [[episode(1.0, [3]), episode(0.0, [2], offset=1)]]
    config = load_config(None, ["rl.kl={coef=0.1, where='reward'}"])
    with pytest.raises(ConfigError, match="needs the policy's trainer") as info:
        batch.prepare(config, groups)
    assert info.value.path == "rl.kl.where"


def test_in_the_loss_the_datums_carry_the_reference_logprobs():
    varied = [with_refs(episode(1.0, [3, 2]), -1.5), with_refs(episode(0.0, [4], offset=1), -1.5)]
    config = load_config(None, ["rl.kl={coef=0.5, where='loss', reference='inference'}"])
    datums, _ = batch.prepare(config, [varied])
    for d in datums:
        mask = d.loss_fn_inputs["mask"].to_numpy() > 0
        refs = d.loss_fn_inputs["ref_logprobs"].to_numpy()
        assert np.all(refs[mask] == -1.5) and np.all(refs[~mask] == 0)


def test_an_inference_reference_attached_by_url_is_refused_at_config_load():
    config = load_config(
        None,
        [
            "rl.kl={coef=0.5, reference='inference'}",
            "inference.options={url='http://127.0.0.1:8000'}",
        ],
    )
    with pytest.raises(ConfigError, match="attaches it to the policy's own server") as info:
        batch.standard.check(config)  # what validate_components asks of the batch preparer
    assert info.value.path == "inference.options.url"
    batch.standard.check(attrs.evolve(config, rl=attrs.evolve(config.rl, kl=KLSection())))


class Reference:
    """A frozen engine that gives every token the logprob -1.5 after a turn of the event loop,
    and counts how many of its calls were in flight at once."""

    def __init__(self, fails: bool = False) -> None:
        self.fails, self.in_flight, self.most_in_flight = fails, 0, 0

    async def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0)
        self.in_flight -= 1
        if self.fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return [None, *[-1.5] * (prompt.length - 1)]


ON_ENGINE = load_config(None, ["rl.kl={coef=0.1, reference='inference'}"])


def test_the_reference_scores_every_turn_of_an_episode_at_once():
    two_turns, engine = episode(1.0, [3, 2]), Reference()
    scored = asyncio.run(batch.standard.annotate(ON_ENGINE, two_turns, [engine, engine]))
    assert [t.ref_logprobs for t in scored.turns] == [(-1.5,) * 3, (-1.5,) * 2]
    assert engine.most_in_flight == 2
    off = load_config(None, [])
    assert asyncio.run(batch.standard.annotate(off, two_turns, [None, None])) is two_turns


def test_a_failing_reference_engine_is_named_as_the_reference():
    with pytest.raises(EngineError, match=r"the KL reference engine \(Reference.*illegal memory"):
        asyncio.run(batch.standard.annotate(ON_ENGINE, episode(1.0, [3]), [Reference(fails=True)]))
