"""Routing replay (R3) in the plait-torch trainer: the experts the sampler recorded are the
experts the trainer's forward uses, scored by the trainer's own router, in every layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plait.api import ConfigError, DataError, Datum, ModelInput, ResolvedModel
from plait_torch.options import TorchTrainerOptions
from plait_torch.trainer import TorchTrainer

RNG = np.random.default_rng(0)
PROMPT = RNG.integers(0, 5000, size=7).tolist()
# Two unrelated sequences and a group of three sharing a prompt (prefix sharing and packing apply).
SEQUENCES = [RNG.integers(0, 5000, size=n).tolist() for n in (12, 9)] + [
    PROMPT + RNG.integers(0, 5000, size=n).tolist() for n in (4, 2, 5)
]


def datums(routing: list[np.ndarray] | None = None) -> list[Datum]:
    out = []
    for i, seq in enumerate(SEQUENCES):
        inputs = {"target_tokens": [*seq[1:], 1], "weights": [1.0] * len(seq)}
        if routing is not None:
            inputs["routed_experts"] = routing[i]
        out.append(Datum(ModelInput.from_ints(seq), inputs))
    return out


def own_routing(trainer: TorchTrainer) -> list[np.ndarray]:
    """What the trainer's routers choose for each sequence alone (no padding, no packing)."""
    hooks = trainer._runner.routing
    routing = []
    with torch.no_grad():
        for seq in SEQUENCES:
            trainer.model(input_ids=torch.tensor([seq]), use_cache=False)
            routing.append(hooks.stacked(hooks.chosen).numpy())
    return routing


def random_routing(top_k: int, experts: int) -> list[np.ndarray]:
    """Random experts for every token, the same for the group's shared prompt (as a sampler that
    ran the prompt once returns them)."""
    routing = [
        np.stack([RNG.permutation(experts)[:top_k] for _ in range(len(seq) * 2)]).reshape(
            len(seq), 2, top_k
        )
        for seq in SEQUENCES
    ]
    for member in routing[3:]:
        member[: len(PROMPT)] = routing[2][: len(PROMPT)]
    return routing


def logprobs(output) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in output.loss_fn_outputs]


@pytest.fixture(scope="module")
def trainers(tiny_moe: ResolvedModel) -> dict[str, TorchTrainer]:
    made = {
        "plain": TorchTrainer(tiny_moe),
        "replay": TorchTrainer(tiny_moe, options=TorchTrainerOptions(routing_replay=True)),
        "replay_padded": TorchTrainer(
            tiny_moe,
            options=TorchTrainerOptions(routing_replay=True, packing=False, prefix_sharing=False),
        ),
    }
    yield made
    for trainer in made.values():
        trainer.close()


def test_replaying_the_trainers_own_routing_changes_nothing(
    trainers: dict[str, TorchTrainer],
) -> None:
    routing = own_routing(trainers["plain"])
    before = logprobs(trainers["plain"].forward(datums(), "cross_entropy"))
    for name in ("replay", "replay_padded"):
        output = trainers[name].forward(datums(routing), "cross_entropy")
        for a, b in zip(before, logprobs(output), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
        assert output.metrics["routing_agreement:mean"] == 1.0
        assert (
            output.metrics["routing_natural_agreement:mean"] > 0.99
        )  # packing moves numerics a hair at most


def test_forced_experts_are_the_ones_used_in_every_layout(
    trainers: dict[str, TorchTrainer],
) -> None:
    shape = trainers["replay"]._runner.routing.shape
    routing = random_routing(shape.top_k, shape.experts)
    outputs = [
        trainers[name].forward(datums(routing), "cross_entropy")
        for name in ("replay", "replay_padded")
    ]
    for output in outputs:
        assert (
            output.metrics["routing_agreement:mean"] == 1.0
        )  # measured on what the experts were given
        assert output.metrics["routing_natural_agreement:mean"] < 0.5
        assert (
            output.metrics["routing_bytes_per_token:mean"] == shape.layers * shape.top_k
        )  # uint8 ids
    for a, b in zip(*(logprobs(o) for o in outputs), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)  # packed + prefix-shared == one padded row each
    own = logprobs(trainers["plain"].forward(datums(), "cross_entropy"))
    assert max(np.abs(a - b).max() for a, b in zip(own, logprobs(outputs[0]), strict=True)) > 1e-3


def test_without_replay_the_trainer_measures_agreement_only(
    trainers: dict[str, TorchTrainer],
) -> None:
    shape = trainers["plain"]._runner.routing.shape
    routing = random_routing(shape.top_k, shape.experts)
    output = trainers["plain"].forward(datums(routing), "cross_entropy")
    assert (
        output.metrics["routing_agreement:mean"]
        == output.metrics["routing_natural_agreement:mean"]
        < 0.5
    )
    np.testing.assert_allclose(
        logprobs(output)[0], logprobs(trainers["plain"].forward(datums(), "cross_entropy"))[0]
    )


def test_replay_trains_the_router(trainers: dict[str, TorchTrainer]) -> None:
    trainer = trainers["replay"]
    shape = trainer._runner.routing.shape
    trainer.forward_backward(datums(random_routing(shape.top_k, shape.experts)), "cross_entropy")
    router_grads = [
        p.grad for name, p in trainer.model.named_parameters() if name.endswith("mlp.gate.weight")
    ]
    assert len(router_grads) == shape.layers and all(
        g is not None and g.abs().sum() > 0 for g in router_grads
    )
    trainer.model.zero_grad(set_to_none=True)


def test_replay_needs_routing_data_and_an_moe_model(
    trainers: dict[str, TorchTrainer], tiny_model: ResolvedModel
) -> None:
    with pytest.raises(DataError, match="enable_return_routed_experts"):
        trainers["replay"].forward(datums(), "cross_entropy")
    wrong = [r[:, :1] for r in own_routing(trainers["plain"])]
    with pytest.raises(DataError, match="2 MoE layers"):
        trainers["replay"].forward(datums(wrong), "cross_entropy")
    with pytest.raises(ConfigError, match=r"trainer\.options\.routing_replay"):
        TorchTrainer(tiny_model, options=TorchTrainerOptions(routing_replay=True))


def test_a_saved_moe_state_loads_back(
    trainers: dict[str, TorchTrainer], tiny_moe: ResolvedModel, tmp_path
) -> None:
    """transformers saves a mixture of experts' fused 3-D expert weights one tensor per expert; the
    trainer's state must load them back (a resumed MoE run failed on it)."""
    trainer = trainers["plain"]
    trainer.forward_backward(datums(), "cross_entropy")
    from plait.api import AdamParams

    trainer.optim_step(AdamParams(learning_rate=1e-3))
    trainer.save_state(str(tmp_path / "state"))
    fresh = TorchTrainer(tiny_moe)
    try:
        fresh.load_state(str(tmp_path / "state"))
        for name, param in trainer.model.named_parameters():
            torch.testing.assert_close(
                dict(fresh.model.named_parameters())[name], param, rtol=0, atol=0
            )
    finally:
        fresh.close()
