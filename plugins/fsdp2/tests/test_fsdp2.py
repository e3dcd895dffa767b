"""plait-fsdp2 beyond the contract kit, on 2 gloo ranks: parity with the single-process reference
trainer, sharded checkpoints, activation checkpointing, mixed precision, bucketed export, and
ranks that die or hang."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from plait.api import AdamParams, DataError, Datum, EngineError, ResolvedModel
from plait_fsdp2.engine import FSDP2Trainer
from plait_fsdp2.options import FSDP2Options
from plait_testing.trainer import (
    SMOOTH_ADAM,
    datum_logprobs,
    random_tokens,
    rl_datum,
    sft_datum,
    weights_of,
)

pytestmark = pytest.mark.distributed

VOCAB = 8192  # tiny-qwen3-8k's
OPTIONS = FSDP2Options(
    world_size=2, device="cpu", threads=1, micro_batch_tokens=64, call_timeout_s=300
)


def grpo_batch(seed: int, groups: int = 2, samples: int = 4) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for g in range(groups):
        prompt = rng.integers(0, VOCAB, 12 + 3 * g).tolist()
        for j in range(samples):
            completion = rng.integers(0, VOCAB, 3 + j).tolist()
            data.append(
                rl_datum(
                    prompt + completion,
                    len(prompt),
                    (-11.0 - 0.2 * rng.random(len(completion))).tolist(),
                    advantage=(-1.0) ** j * (1 + g),
                )
            )
    return data


def sft_batch(seed: int) -> list[Datum]:
    return [sft_datum(random_tokens(seed * 10 + i, 9 + 4 * i, VOCAB)) for i in range(3)]


STEPS = [
    (grpo_batch(1), "ppo"),
    (sft_batch(2), "cross_entropy"),
    (grpo_batch(3), "importance_sampling"),
]


def train(trainer, steps=STEPS) -> list[float]:
    """loss, grad norm, loss, grad norm, ... of one optimizer step per (data, loss)."""
    record = []
    for data, loss in steps:
        out = trainer.forward_backward(data, loss)
        record += [out.metrics["loss:sum"], trainer.optim_step(SMOOTH_ADAM).metrics["grad_norm"]]
    return record


def assert_same_weights(
    expected: dict[str, np.ndarray], actual: dict[str, np.ndarray], atol: float = 1e-6
) -> None:
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        np.testing.assert_allclose(actual[name], tensor, atol=atol, rtol=1e-5, err_msg=name)


def test_two_ranks_train_like_one_process(full_vocabulary_model: ResolvedModel) -> None:
    """Losses, gradient norms and weights over three steps equal those of plait-torch's trainer.

    SMOOTH_ADAM's first update is lr * g / (|g| + 1), strictly monotonic in every gradient element,
    so equal weights after it mean equal gradients, element by element."""
    torch_trainer = pytest.importorskip("plait_torch.trainer")
    from plait_torch.options import TorchTrainerOptions

    reference = torch_trainer.TorchTrainer(
        full_vocabulary_model, options=TorchTrainerOptions(packing=False, prefix_sharing=False)
    )
    first_data, first_loss = STEPS[0]
    reference.forward_backward(first_data, first_loss)
    reference.optim_step(SMOOTH_ADAM)
    after_first = weights_of(reference)
    expected = train(reference, STEPS[1:])
    expected_weights = weights_of(reference)

    fsdp = FSDP2Trainer(full_vocabulary_model, options=OPTIONS)
    try:
        assert fsdp.capabilities.packing and fsdp.capabilities.prefix_sharing
        out = fsdp.forward_backward(first_data, first_loss)
        assert out.metrics["prefix_shared_tokens:sum"] > 0, "GRPO groups share their prompts"
        fsdp.optim_step(SMOOTH_ADAM)
        assert_same_weights(after_first, weights_of(fsdp))
        actual = train(fsdp, STEPS[1:])
        assert actual == pytest.approx(expected, rel=1e-4, abs=1e-5)
        assert_same_weights(expected_weights, weights_of(fsdp), atol=1e-5)
    finally:
        fsdp.close()


def test_the_entropy_bonus_is_the_mean_over_the_whole_call(tiny_model: ResolvedModel) -> None:
    """Each rank holds a share of the call but normalises its entropy bonus by the positions of
    the whole call: the bonus and the gradient are one process's."""
    torch_trainer = pytest.importorskip("plait_torch.trainer")
    data, config = grpo_batch(4), {"entropy_coef": 5.0}
    reference = torch_trainer.TorchTrainer(tiny_model)
    expected = reference.forward_backward(data, "gspo", config).metrics
    expected_norm = reference.optim_step(SMOOTH_ADAM).metrics["grad_norm"]
    fsdp = FSDP2Trainer(tiny_model, options=OPTIONS)
    try:
        actual = fsdp.forward_backward(data, "gspo", config).metrics
        for key in ("entropy_bonus:sum", "loss:sum"):
            assert actual[key] == pytest.approx(expected[key], rel=1e-5), key
        norm = fsdp.optim_step(SMOOTH_ADAM).metrics["grad_norm"]
        assert norm == pytest.approx(expected_norm, rel=1e-4)
    finally:
        fsdp.close()


def test_a_checkpoint_saved_on_two_ranks_resumes_identically(
    tiny_model: ResolvedModel, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    original = FSDP2Trainer(tiny_model, options=OPTIONS)
    try:
        train(original, STEPS[:1])
        original.forward_backward(sft_batch(9), "cross_entropy")  # pending gradients are saved too
        original.save_state(state)
        saved_weights = weights_of(original)
        expected = train(original, STEPS[1:])
        expected_weights = weights_of(original)
    finally:
        original.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]

    resumed = FSDP2Trainer(tiny_model, options=OPTIONS)
    try:
        resumed.load_state(state)
        assert resumed.weight_version == 1
        assert train(resumed, STEPS[1:]) == pytest.approx(expected, rel=1e-6)
        assert_same_weights(expected_weights, weights_of(resumed), atol=1e-7)
    finally:
        resumed.close()

    one_rank = FSDP2Trainer(tiny_model, options=FSDP2Options(world_size=1, device="cpu", threads=1))
    try:
        one_rank.load_state(state)  # resharded from 2 ranks to 1
        assert_same_weights(saved_weights, weights_of(one_rank), atol=0)
        assert train(one_rank, STEPS[1:]) == pytest.approx(expected, rel=1e-4)
    finally:
        one_rank.close()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_the_gradients(tiny_model: ResolvedModel, mode: str) -> None:
    results = []
    for setting in ("none", mode):
        trainer = FSDP2Trainer(
            tiny_model,
            options=FSDP2Options(
                world_size=2,
                device="cpu",
                threads=1,
                activation_checkpointing=setting,
                call_timeout_s=300,
            ),
        )
        try:
            results.append((train(trainer, STEPS[:1]), weights_of(trainer)))
        finally:
            trainer.close()
    (plain, plain_weights), (checkpointed, checkpointed_weights) = results
    assert checkpointed == pytest.approx(plain, rel=1e-5)
    assert_same_weights(plain_weights, checkpointed_weights)


def test_bfloat16_models_train_with_float32_master_weights(tiny_model: ResolvedModel) -> None:
    data = sft_batch(4)
    bf16 = ResolvedModel(
        tiny_model.name, tiny_model.path, tiny_model.tokenizer_path, dtype="bfloat16"
    )
    full = FSDP2Trainer(tiny_model, options=OPTIONS)
    mixed = FSDP2Trainer(bf16, options=OPTIONS)
    try:
        expected = datum_logprobs(full.forward(data))
        for a, b in zip(expected, datum_logprobs(mixed.forward(data)), strict=True):
            np.testing.assert_allclose(b, a, atol=0.1)
        assert {str(t.dtype) for _, t in mixed.export_weights()} == {"torch.float32"}
        losses = [mixed.forward_backward(data, "cross_entropy").metrics["loss:sum"]]
        mixed.optim_step(AdamParams(learning_rate=1e-2))
        losses.append(mixed.forward(data).metrics["loss:sum"])
        assert losses[1] < losses[0]
    finally:
        full.close()
        mixed.close()


def test_export_streams_buckets_and_matches_the_checkpoint(tiny_model: ResolvedModel) -> None:
    from plait_testing.trainer import checkpoint_tensors

    trainer = FSDP2Trainer(
        tiny_model,
        options=FSDP2Options(world_size=2, device="cpu", threads=1, export_bucket_mb=0.1),
    )
    calls = []
    call = trainer._group.call
    trainer._group.call = lambda method, *args, **kw: (
        calls.append(method) or call(method, *args, **kw)
    )
    try:
        stream = trainer.export_weights()
        name, tensor = next(stream)
        assert calls == ["export_plan", "export_bucket"], (
            "the first tensor comes before the rest is gathered"
        )
        exported = {name: tensor.numpy().copy(), **{n: t.numpy().copy() for n, t in stream}}
        # the 8192 x 128 embedding alone is 4 MiB, a bucket of its own; the other ~1.5 MiB in
        # buckets of at most 0.1 MiB (or one tensor)
        plan = trainer._group.call("export_plan", timeout_s=60)[0]
        assert calls.count("export_bucket") == len(plan) > 10
        sizes = {name: 4 * int(np.prod(tensor.shape)) for name, tensor in exported.items()}
        assert all(
            len(bucket) == 1 or sum(sizes[n] for n, _ in bucket) <= 0.1 * 2**20 for bucket in plan
        )
        on_disk = checkpoint_tensors(tiny_model)
        assert exported.keys() <= on_disk.keys()
        for key, value in exported.items():
            np.testing.assert_array_equal(value, on_disk[key].astype(np.float32), err_msg=key)
        abandoned = trainer.export_weights()
        next(abandoned)
        del abandoned  # a half-read export leaves the ranks ready for the next call
        assert np.isfinite(trainer.forward(sft_batch(1)).metrics["loss:sum"])
    finally:
        trainer._group.call = call
        trainer.close()


def test_bad_input_fails_in_the_controller_and_leaves_the_trainer_usable(
    tiny_model: ResolvedModel,
) -> None:
    trainer = FSDP2Trainer(tiny_model, options=OPTIONS)
    try:
        with pytest.raises(DataError, match="clip_low"):
            trainer.forward_backward(grpo_batch(1), "ppo", {"clip_low": 0.5})
        with pytest.raises(DataError, match=str(VOCAB + 3)):
            trainer.forward([sft_datum([1, 2, VOCAB + 3, 4])])
        assert np.isfinite(trainer.forward_backward(grpo_batch(1), "ppo").metrics["loss:sum"])
    finally:
        trainer.close()


def _stack_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("plait-*-stacks-*"))


def test_a_rank_that_dies_fails_the_call_naming_it(tiny_model: ResolvedModel) -> None:
    before = _stack_dirs()
    trainer = FSDP2Trainer(tiny_model, options=OPTIONS)
    try:
        os.kill(trainer.pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(
            EngineError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL during forward_backward"
        ):
            trainer.forward_backward(grpo_batch(1), "ppo")
        assert time.monotonic() - start < 60, (
            "a death is noticed at once, not after the call timeout"
        )
        with pytest.raises(EngineError, match="worker processes are stopped"):
            trainer.forward(sft_batch(1))
    finally:
        trainer.close()
    assert not any(_alive(pid) for pid in trainer.pids)
    assert _stack_dirs() == before, "no hang was diagnosed: the per-rank stack files are removed"


def test_a_rank_that_hangs_is_named_within_the_timeout(tiny_model: ResolvedModel) -> None:
    trainer = FSDP2Trainer(
        tiny_model, options=FSDP2Options(world_size=2, device="cpu", threads=1, call_timeout_s=20)
    )
    try:
        os.kill(trainer.pids[1], signal.SIGSTOP)  # alive, but never answers
        start = time.monotonic()
        with pytest.raises(
            EngineError,
            match=r"rank\(s\) \[1\] did not answer forward_backward within 20 s "
            r"\(rank\(s\) \[0\] wait for them in a collective\)",
        ) as info:
            trainer.forward_backward(grpo_batch(1), "ppo")
        assert time.monotonic() - start < 60
    finally:
        trainer.close()
    assert not any(_alive(pid) for pid in trainer.pids)
    kept = Path(info.value.message.rsplit("full stack dumps: ", 1)[1].splitlines()[0])
    assert (kept / "rank1.txt").is_file(), (
        "a diagnosed hang keeps the stack dumps its error points at"
    )
    shutil.rmtree(kept)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie until its parent (the forkserver) reaps it
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"
