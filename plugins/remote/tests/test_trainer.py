"""The "remote" trainer engine (plait-torch behind `plait serve trainer`) against the trainer
contract kit, and what the service refuses."""

from __future__ import annotations

import httpx
import pytest

from plait.api import DataError, EngineError, ResolvedModel
from plait_testing.trainer import TrainerEngineContract, random_tokens, sft_datum, vocab_size


class TestRemoteTrainer(TrainerEngineContract):
    required_metrics = (
        "loss:sum",
        "entropy:mean",
        "model_flops:sum",
    )  # plait-torch's, across the wire

    @pytest.fixture
    def model(self, tiny_model: ResolvedModel) -> ResolvedModel:
        return tiny_model

    @pytest.fixture
    def make_trainer(self, model: ResolvedModel, trainer_service_url: str, remote_trainer_options):
        from plait_remote.trainer import RemoteTrainer

        return lambda: RemoteTrainer(
            model, options=remote_trainer_options(url=trainer_service_url), seed=0
        )


def test_the_trainer_service_refuses_what_it_cannot_do(
    trainer_service_url: str, tiny_model: ResolvedModel, remote_trainer_options
) -> None:
    from plait_remote.trainer import RemoteTrainer

    vocab = vocab_size(tiny_model)
    with httpx.Client(base_url=trainer_service_url, timeout=60) as client:
        missing = client.post(
            "/trainers/t999/forward", json={"data": [], "loss_fn": "cross_entropy"}
        )
        assert (
            missing.status_code == 404 and "no trainer 't999'" in missing.json()["error"]["message"]
        )
        created = client.post("/trainers", json={}).json()["id"]
        bad = client.post(
            f"/trainers/{created}/forward_backward",
            json={"data": "nope", "loss_fn": "cross_entropy"},
        )
        assert bad.status_code == 400 and "'data' is not valid" in bad.json()["error"]["message"]
        assert client.delete(f"/trainers/{created}").json() == {"deleted": True}

    trainer = RemoteTrainer(
        tiny_model, options=remote_trainer_options(url=trainer_service_url), seed=0
    )
    try:
        with pytest.raises(
            DataError, match=str(vocab + 3)
        ):  # the engine's own DataError, across the wire
            trainer.forward([sft_datum([1, 2, vocab + 3])])
        out = trainer.forward(
            [sft_datum(random_tokens(0, 6, vocab))]
        )  # and the trainer still serves
        assert len(out.loss_fn_outputs) == 1
    finally:
        trainer.close()
    with pytest.raises(EngineError, match="closed"):
        trainer.forward([sft_datum([1, 2, 3])])


@pytest.mark.slow  # 8 s, killing a service: with the slow tests (make check < 5 min)
def test_a_trainer_service_that_dies_is_named_with_its_log(
    tiny_model: ResolvedModel, remote_trainer_options
) -> None:
    import os
    import signal

    from plait_remote.trainer import RemoteTrainer

    trainer = RemoteTrainer(tiny_model, options=remote_trainer_options(), seed=0)
    try:
        os.kill(trainer.server.pid, signal.SIGKILL)
        trainer.server.process.wait(30)
        with pytest.raises(
            EngineError, match=r"exited with code -9 \(during POST /trainers/t1/forward\)"
        ):
            trainer.forward([sft_datum([1, 2, 3])])
    finally:
        trainer.close()


def test_the_disk_sync_has_the_service_write_weights_where_the_engines_load_them(
    trainer_service_url: str,
    tiny_model: ResolvedModel,
    remote_trainer_options,
    make_attached,
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trainer service writes the new version into the disk sync's directory itself: the
    controller never reads the weights, and an engine in a server (loads the directory) and one
    in this process (reads the update back) both end up with the trained weights."""
    import asyncio

    import numpy as np

    from plait.api import AdamParams, ModelInput
    from plait_remote.trainer import RemoteTrainer
    from plait_torch.inference import TorchInferenceEngine
    from plait_weights.sync import MANIFEST_FILE, WEIGHTS_FILE, DiskSync, DiskSyncOptions

    trainer = RemoteTrainer(
        tiny_model, options=remote_trainer_options(url=trainer_service_url), seed=0
    )
    remote, local = make_attached(), TorchInferenceEngine(tiny_model, seed=0)
    sync = DiskSync(options=DiskSyncOptions(directory=str(tmp_path / "weights")))
    prompt = ModelInput.from_ints(random_tokens(1, 12, vocab_size(tiny_model)))
    try:
        before = asyncio.run(local.compute_logprobs(prompt))
        trainer.forward_backward(
            [sft_datum(random_tokens(0, 16, vocab_size(tiny_model)))], "cross_entropy"
        )
        version = trainer.optim_step(AdamParams(learning_rate=1e-2)).weight_version

        def read_by_the_controller(self):  # the point of the fast path: never called
            raise AssertionError("the controller read the weights")

        with monkeypatch.context() as patched:
            patched.setattr(RemoteTrainer, "export_weights", read_by_the_controller)
            stats = asyncio.run(sync.push(trainer, [remote, local], version))
        written = tmp_path / "weights" / f"v{version}"
        assert (written / WEIGHTS_FILE).stat().st_size == stats.bytes > 0
        assert (written / MANIFEST_FILE).exists()
        assert remote.weight_version == local.weight_version == version

        trained = dict(trainer.export_weights())
        served = local.model.state_dict()
        assert set(trained) <= set(served)
        for name, tensor in trained.items():
            np.testing.assert_array_equal(served[name].numpy(), tensor.numpy(), err_msg=name)
        after = asyncio.run(local.compute_logprobs(prompt))
        assert after != before
        np.testing.assert_allclose(
            asyncio.run(remote.compute_logprobs(prompt))[1:], after[1:], atol=1e-5
        )
    finally:
        trainer.close()
        asyncio.run(remote.close())
        asyncio.run(local.close())


@pytest.mark.slow  # launches a service of its own (as a run's `[critic]` with engine "remote")
def test_a_critic_runs_as_a_service(tiny_model: ResolvedModel, remote_trainer_options) -> None:
    """A value model behind `plait serve trainer`: its capability and its values cross the wire,
    and the value loss trains it there."""
    import numpy as np

    from plait.api import AdamParams, Datum, ModelInput
    from plait_remote.trainer import RemoteTrainer

    options = remote_trainer_options(engine_options={"value_head": True})
    critic = RemoteTrainer(tiny_model, options=options, seed=0)
    try:
        assert critic.capabilities.value_head
        tokens = random_tokens(0, 8, vocab_size(tiny_model))
        mask = np.asarray([0, 0, 1, 1, 1, 1, 1], np.float32)
        datum = Datum(
            ModelInput.from_ints(tokens[:-1]),
            {
                "target_tokens": tokens[1:],
                "mask": mask,
                "returns": mask,
                "values": np.zeros(7, np.float32),
                "weights": mask / mask.sum(),
            },
        )
        (before,) = critic.forward([datum], "value").loss_fn_outputs
        assert np.all(before["values"].to_numpy() == 0.0)  # a new head values every state at 0
        for _ in range(3):
            critic.forward_backward([datum], "value", {"value_clip": 0.0})
            critic.optim_step(AdamParams(learning_rate=3e-3))
        (after,) = critic.forward([datum], "value").loss_fn_outputs
        assert after["values"].to_numpy()[2:].mean() > 0.1  # towards the returns of 1
    finally:
        critic.close()
