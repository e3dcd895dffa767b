"""Contract tests for trainer engines (`plait.protocols.TrainerEngine`).

A trainer plugin subclasses `TrainerEngineContract` in its own tests and provides two fixtures:

    from plait_testing.trainer import TrainerEngineContract

    class TestMyTrainer(TrainerEngineContract):
        @pytest.fixture
        def model(self, tiny_model):           # a ResolvedModel (a small checkpoint)
            return tiny_model

        @pytest.fixture
        def make_trainer(self, model):         # () -> a fresh engine on the model's initial weights
            return lambda: MyTrainer(model, options=..., seed=0)

The checks are model-agnostic: they use random token ids of the model's vocabulary and compare
the engine with itself (alignment, batching, accumulation, save/load) and with the checkpoint on
disk (exported weight names, shapes and values). Class attributes set the tolerances and the
metric keys an engine promises beyond "loss:sum".
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plait.api import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    PlaitError,
    ResolvedModel,
    TrainerEngine,
)

MakeTrainer = Callable[[], TrainerEngine]

REDUCTIONS = ("sum", "mean", "max", "min")
RL_LOSSES: dict[str, dict[str, float]] = {
    "importance_sampling": {},
    "ppo": {},
    "cispo": {},
    "dro": {"beta": 0.1},
    "gspo": {},
    "ppo_dual_clip": {},
}
# Adam with a large eps is close to SGD (update ~ lr * g / eps), so its updates depend smoothly on
# the gradient: small numerical differences in the gradient give small differences in the weights.
SMOOTH_ADAM = AdamParams(learning_rate=1e-1, eps=1.0)


# -- data helpers (shared with the inference kit) ----------------------------------------------


def vocab_size(model: ResolvedModel) -> int:
    """The model's embedding rows, from its config.json."""
    config = json.loads((Path(model.path) / "config.json").read_text())
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not size:
        raise AssertionError(f"{model.path}/config.json has no vocab_size")
    return int(size)


def random_tokens(seed: int, length: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=length).tolist()


def sft_datum(tokens: Sequence[int], weights: Sequence[float] | None = None) -> Datum:
    """Next-token datum of a sequence: input tokens[:-1], targets tokens[1:]."""
    tokens = list(tokens)
    n = len(tokens) - 1
    return Datum(
        ModelInput.from_ints(tokens[:-1]),
        {
            "target_tokens": tokens[1:],
            "weights": list(weights) if weights is not None else [1.0] * n,
        },
    )


def rl_datum(
    tokens: Sequence[int], prompt_len: int, sampler_logprobs: Iterable[float], advantage: float
) -> Datum:
    """An RL datum: the completion (tokens after `prompt_len`) carries advantage and sampler
    logprobs."""
    tokens = list(tokens)
    n = len(tokens) - 1
    active = [1.0 if i + 1 >= prompt_len else 0.0 for i in range(n)]
    logprobs = [0.0] * (prompt_len - 1) + list(sampler_logprobs)
    assert len(logprobs) == n, "one sampler logprob per completion token"
    return Datum(
        ModelInput.from_ints(tokens[:-1]),
        {
            "target_tokens": tokens[1:],
            "logprobs": logprobs,
            "advantages": [advantage * a for a in active],
            "mask": active,
        },
    )


def datum_logprobs(out: ForwardBackwardOutput) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].to_numpy(), dtype=np.float64) for o in out.loss_fn_outputs]


def to_numpy(tensor: Any) -> np.ndarray:
    """A torch tensor (any dtype/device) or array as a float64 numpy array, without importing
    torch."""
    if hasattr(tensor, "detach"):
        tensor = tensor.detach().cpu().float().numpy()
    return np.asarray(tensor, dtype=np.float64)


def checkpoint_tensors(model: ResolvedModel) -> dict[str, np.ndarray]:
    """The tensors of the checkpoint's safetensors files, by name."""
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    files = sorted(Path(model.path).glob("*.safetensors"))
    assert files, f"no safetensors files in {model.path}"
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[name] = to_numpy(handle.get_tensor(name))
    return out


def weights_of(trainer: TrainerEngine) -> dict[str, np.ndarray]:
    return {name: to_numpy(tensor).copy() for name, tensor in trainer.export_weights()}


def assert_metric_keys(metrics: Iterable[str]) -> None:
    for key in metrics:
        name, sep, reduction = key.rpartition(":")
        assert sep and name and reduction in REDUCTIONS, (
            f"metric key {key!r} is not 'name:reduction'"
        )


# -- the contract -------------------------------------------------------------------------------


class TrainerEngineContract:
    """The promises of `plait.protocols.TrainerEngine`, checked against a small model."""

    logprob_atol: float = 1e-4
    """Same weights, different batching or padding: target logprobs agree within this."""
    step_atol: float = 1e-3
    """Two ways to the same update (accumulated vs one batch): logprobs afterwards agree within
    this."""
    required_metrics: tuple[str, ...] = ("loss:sum",)
    """Metric keys every forward/forward_backward must report."""
    seq_len: int = 12

    @pytest.fixture
    def model(self) -> ResolvedModel:
        raise NotImplementedError("subclass TrainerEngineContract and provide a `model` fixture")

    @pytest.fixture
    def make_trainer(self, model: ResolvedModel) -> MakeTrainer:
        raise NotImplementedError(
            "subclass TrainerEngineContract and provide a `make_trainer` fixture"
        )

    @pytest.fixture
    def vocab(self, model: ResolvedModel) -> int:
        return vocab_size(model)

    @pytest.fixture
    def trainer(self, make_trainer: MakeTrainer) -> Iterable[TrainerEngine]:
        engine = make_trainer()
        yield engine
        engine.close()

    def data(self, vocab: int, count: int = 3, seed: int = 0) -> list[Datum]:
        lengths = [
            self.seq_len + 1 - 3 * (i % 3) for i in range(count)
        ]  # mixed lengths: padding paths
        return [sft_datum(random_tokens(seed * 100 + i, n, vocab)) for i, n in enumerate(lengths)]

    # -- protocol and outputs -------------------------------------------------------------------

    def test_implements_the_protocol(self, trainer: TrainerEngine) -> None:
        assert isinstance(trainer, TrainerEngine)
        assert trainer.weight_version == 0

    def test_forward_returns_target_logprobs_per_datum(
        self, trainer: TrainerEngine, vocab: int
    ) -> None:
        data = self.data(vocab)
        out = trainer.forward(data, "cross_entropy")
        assert len(out.loss_fn_outputs) == len(data)
        for datum, lp in zip(data, datum_logprobs(out), strict=True):
            assert lp.shape == (datum.model_input.length,)
            assert np.all(np.isfinite(lp)) and np.all(lp <= 1e-6), (
                "logprobs must be finite and <= 0"
            )
        for key in self.required_metrics:
            assert key in out.metrics, f"forward metrics lack {key!r}: {sorted(out.metrics)}"
        assert_metric_keys(out.metrics)
        expected = -sum(
            float((lp * d.loss_fn_inputs["weights"].to_numpy()).sum())
            for lp, d in zip(datum_logprobs(out), data, strict=True)
        )
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4), (
            "cross_entropy is -(lp * weights).sum()"
        )
        assert trainer.weight_version == 0, "forward must not step"

    def test_position_i_predicts_target_i(self, trainer: TrainerEngine, vocab: int) -> None:
        """Changing target j changes logprob j only; changing input j changes logprobs j.. only."""
        tokens = random_tokens(1, self.seq_len + 1, vocab)
        j = self.seq_len // 2
        base = datum_logprobs(trainer.forward([sft_datum(tokens)]))[0]

        targets = list(tokens[1:])
        targets[j] = (targets[j] + 1) % vocab
        datum = Datum(
            ModelInput.from_ints(tokens[:-1]),
            {"target_tokens": targets, "weights": [1.0] * self.seq_len},
        )
        changed = np.abs(datum_logprobs(trainer.forward([datum]))[0] - base) > self.logprob_atol
        assert changed.tolist() == [i == j for i in range(self.seq_len)], (
            f"changing target {j} changed logprobs at {np.flatnonzero(changed).tolist()}; "
            "position i must score target_tokens[i]"
        )

        inputs = list(tokens[:-1])
        inputs[j] = (inputs[j] + 1) % vocab
        datum = Datum(
            ModelInput.from_ints(inputs),
            {"target_tokens": tokens[1:], "weights": [1.0] * self.seq_len},
        )
        moved = np.abs(datum_logprobs(trainer.forward([datum]))[0] - base) > self.logprob_atol
        assert not moved[:j].any(), "a position must not see later inputs (causal attention)"
        assert moved[j], "position j must depend on input j"

    def test_batching_and_padding_do_not_change_logprobs(
        self, trainer: TrainerEngine, vocab: int
    ) -> None:
        data = self.data(vocab, count=4, seed=2)
        together = datum_logprobs(trainer.forward(data))
        for i, datum in enumerate(data):
            alone = datum_logprobs(trainer.forward([datum]))[0]
            np.testing.assert_allclose(
                together[i],
                alone,
                atol=self.logprob_atol,
                err_msg=f"datum {i} scored differently in a batch than alone",
            )

    def test_forward_backward_reports_metrics_and_logprobs(
        self, trainer: TrainerEngine, vocab: int
    ) -> None:
        data = self.data(vocab)
        forward = datum_logprobs(trainer.forward(data))
        out = trainer.forward_backward(data, "cross_entropy")
        for key in self.required_metrics:
            assert key in out.metrics, (
                f"forward_backward metrics lack {key!r}: {sorted(out.metrics)}"
            )
        assert_metric_keys(out.metrics)
        for a, b in zip(forward, datum_logprobs(out), strict=True):
            np.testing.assert_allclose(a, b, atol=self.logprob_atol)

    @pytest.mark.parametrize("loss", sorted(RL_LOSSES))
    def test_rl_losses_train(self, trainer: TrainerEngine, vocab: int, loss: str) -> None:
        prompt_len, completion = 5, 6
        tokens = [random_tokens(10 + i, prompt_len + completion, vocab) for i in range(2)]
        sampler = [
            datum_logprobs(trainer.forward([sft_datum(t)]))[0][prompt_len - 1 :] - 0.05
            for t in tokens
        ]
        data = [
            rl_datum(t, prompt_len, s, adv)
            for t, s, adv in zip(tokens, sampler, (1.0, -1.0), strict=True)
        ]
        out = trainer.forward_backward(data, loss, RL_LOSSES[loss])
        assert math.isfinite(out.metrics["loss:sum"])
        assert_metric_keys(out.metrics)
        step = trainer.optim_step(AdamParams(learning_rate=1e-3))
        assert math.isfinite(step.metrics["grad_norm"]) and step.metrics["grad_norm"] > 0

    # -- optimizer --------------------------------------------------------------------------------

    def test_optim_step_bumps_the_version_and_changes_the_weights(
        self, trainer: TrainerEngine, vocab: int
    ) -> None:
        data = self.data(vocab)
        before_lp = datum_logprobs(trainer.forward(data))
        before_w = weights_of(trainer)
        trainer.forward_backward(data, "cross_entropy")
        step = trainer.optim_step(AdamParams(learning_rate=1e-3))
        assert step.weight_version == 1 and trainer.weight_version == 1
        assert "grad_norm" in step.metrics and step.metrics["grad_norm"] > 0
        after_w = weights_of(trainer)
        assert any(not np.array_equal(before_w[n], after_w[n]) for n in before_w), (
            "optim_step changed no weight"
        )
        after_lp = datum_logprobs(trainer.forward(data))
        assert any(
            np.abs(a - b).max() > self.logprob_atol
            for a, b in zip(before_lp, after_lp, strict=True)
        )

    def test_cross_entropy_steps_lower_the_loss(self, trainer: TrainerEngine, vocab: int) -> None:
        data = self.data(vocab, count=2)
        losses = []
        for _ in range(3):
            losses.append(trainer.forward_backward(data, "cross_entropy").metrics["loss:sum"])
            trainer.optim_step(AdamParams(learning_rate=1e-2))
        losses.append(trainer.forward(data).metrics["loss:sum"])
        assert losses[-1] < losses[0], (
            f"three steps on the same data did not lower the loss: {losses}"
        )

    def test_forward_does_not_accumulate_gradients(
        self, trainer: TrainerEngine, vocab: int
    ) -> None:
        """forward leaves no gradient behind: a step right after it moves no weight."""
        probe = self.data(vocab, seed=5)
        before = datum_logprobs(trainer.forward(probe, "cross_entropy"))
        trainer.optim_step(SMOOTH_ADAM)
        for x, y in zip(before, datum_logprobs(trainer.forward(probe)), strict=True):
            np.testing.assert_allclose(x, y, atol=self.logprob_atol)

    def test_accumulated_gradients_equal_one_batch(
        self, make_trainer: MakeTrainer, vocab: int
    ) -> None:
        data, probe = self.data(vocab, count=3), self.data(vocab, seed=7)
        split, whole = make_trainer(), make_trainer()
        try:
            split.forward_backward(data[:2], "cross_entropy")
            split.forward_backward(data[2:], "cross_entropy")
            whole.forward_backward(data, "cross_entropy")
            norm_split = split.optim_step(SMOOTH_ADAM).metrics["grad_norm"]
            norm_whole = whole.optim_step(SMOOTH_ADAM).metrics["grad_norm"]
            assert norm_split == pytest.approx(norm_whole, rel=1e-4), (
                "gradients must add up across calls"
            )
            for x, y in zip(
                datum_logprobs(split.forward(probe)),
                datum_logprobs(whole.forward(probe)),
                strict=True,
            ):
                np.testing.assert_allclose(x, y, atol=self.step_atol)
        finally:
            split.close()
            whole.close()

    def test_grad_norm_is_measured_before_clipping(
        self, make_trainer: MakeTrainer, vocab: int
    ) -> None:
        data, probe = self.data(vocab), self.data(vocab, seed=9)
        free, clipped = make_trainer(), make_trainer()
        try:
            start = datum_logprobs(free.forward(probe))
            free.forward_backward(data, "cross_entropy")
            clipped.forward_backward(data, "cross_entropy")
            norm = free.optim_step(SMOOTH_ADAM).metrics["grad_norm"]
            tight = AdamParams(
                learning_rate=SMOOTH_ADAM.learning_rate,
                eps=SMOOTH_ADAM.eps,
                grad_clip_norm=norm / 100,
            )
            assert clipped.optim_step(tight).metrics["grad_norm"] == pytest.approx(norm, rel=1e-4)
            moved_free = sum(
                np.abs(a - s).sum()
                for a, s in zip(datum_logprobs(free.forward(probe)), start, strict=True)
            )
            moved_clipped = sum(
                np.abs(a - s).sum()
                for a, s in zip(datum_logprobs(clipped.forward(probe)), start, strict=True)
            )
            assert moved_clipped < moved_free / 5, (
                "clipping the gradient to 1% must shrink the update"
            )
        finally:
            free.close()
            clipped.close()

    # -- state and weights ------------------------------------------------------------------------

    def test_save_and_load_continue_identically(
        self, make_trainer: MakeTrainer, vocab: int, tmp_path: Path
    ) -> None:
        first, second, probe = self.data(vocab), self.data(vocab, seed=3), self.data(vocab, seed=4)
        original, restored = make_trainer(), make_trainer()
        state = tmp_path / "state"
        try:
            original.forward_backward(first, "cross_entropy")
            original.optim_step(AdamParams(learning_rate=1e-2))
            original.save_state(state)
            original.save_state(state)  # saving over an existing state replaces it
            assert sorted(p.name for p in tmp_path.iterdir()) == ["state"], (
                "temporary files were left behind"
            )

            original.forward_backward(second, "cross_entropy")
            expected_norm = original.optim_step(AdamParams(learning_rate=1e-2)).metrics["grad_norm"]
            expected = datum_logprobs(original.forward(probe))

            restored.load_state(state)
            assert restored.weight_version == 1
            restored.forward_backward(second, "cross_entropy")
            step = restored.optim_step(AdamParams(learning_rate=1e-2))
            assert step.weight_version == 2
            assert step.metrics["grad_norm"] == pytest.approx(expected_norm, rel=1e-5)
            for x, y in zip(expected, datum_logprobs(restored.forward(probe)), strict=True):
                # The optimizer state (Adam moments) must come back too, or the second step differs.
                np.testing.assert_allclose(x, y, atol=1e-5)
        finally:
            original.close()
            restored.close()

    def test_export_weights_match_the_checkpoint(
        self, trainer: TrainerEngine, model: ResolvedModel
    ) -> None:
        exported = weights_of(trainer)
        on_disk = checkpoint_tensors(model)
        assert exported, "export_weights yielded nothing"
        unknown = sorted(set(exported) - set(on_disk))
        assert not unknown, (
            f"exported names the checkpoint does not have (not Hugging Face names?): {unknown[:5]}"
        )
        for name, tensor in exported.items():
            assert tensor.shape == on_disk[name].shape, (
                f"{name}: exported {tensor.shape}, checkpoint {on_disk[name].shape}"
            )
            np.testing.assert_allclose(
                tensor,
                on_disk[name],
                atol=1e-6,
                err_msg=f"{name} differs from the checkpoint before any step",
            )

    # -- bad input --------------------------------------------------------------------------------

    def test_unknown_loss_is_a_clear_error(self, trainer: TrainerEngine, vocab: int) -> None:
        with pytest.raises(PlaitError, match="no_such_loss"):
            trainer.forward_backward(self.data(vocab), "no_such_loss")

    def test_missing_loss_inputs_are_a_clear_error(
        self, trainer: TrainerEngine, vocab: int
    ) -> None:
        with pytest.raises((PlaitError, ValueError), match="advantages"):
            trainer.forward_backward(self.data(vocab), "ppo")

    def test_token_outside_the_vocabulary_is_a_clear_error(
        self, trainer: TrainerEngine, vocab: int
    ) -> None:
        tokens = random_tokens(0, self.seq_len + 1, vocab)
        tokens[3] = vocab + 5
        with pytest.raises((PlaitError, ValueError), match=str(vocab + 5)):
            trainer.forward([sft_datum(tokens)])

    def test_empty_data_is_a_clear_error(self, trainer: TrainerEngine) -> None:
        with pytest.raises((PlaitError, ValueError)):
            trainer.forward_backward([], "cross_entropy")
