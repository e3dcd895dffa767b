"""The unmodified tinker 0.38 SDK drives `plait serve tinker` through a whole training run."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
types = tinker.types

pytestmark = pytest.mark.timeout(600)


def datum(tokens: list[int], **inputs: list[float]) -> types.Datum:
    """Next-token data: the model reads tokens[:-1] and is scored on tokens[1:]."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **inputs},
    )


def sft(tokens: list[int]) -> types.Datum:
    return datum(tokens, weights=[1.0] * (len(tokens) - 1))


def rl(tokens: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    n = len(tokens) - 1
    return datum(tokens, logprobs=logprobs, advantages=[advantage] * n)


PHRASE = [1000 + 37 * i for i in range(12)]


def test_the_whole_sequence_of_a_training_run(service_client, base_model: str) -> None:
    BASE = base_model
    training = service_client.create_lora_training_client(base_model=BASE, rank=8).result()
    info = training.get_info()
    assert info.model_data.model_name == BASE and info.is_lora

    # forward_backward with every built-in loss; the logprobs come back per datum
    first = training.forward([sft(PHRASE)], "cross_entropy").result()
    start = float(np.mean(first.loss_fn_outputs[0]["logprobs"].to_numpy()))
    old = first.loss_fn_outputs[0]["logprobs"].tolist()
    for loss in ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro"):
        data = [sft(PHRASE)] if loss == "cross_entropy" else [rl(PHRASE, old, 1.0)]
        out = training.forward_backward(
            data, loss, {"beta": 0.1} if loss == "dro" else None
        ).result()
        assert (
            len(out.loss_fn_outputs) == 1
            and len(out.loss_fn_outputs[0]["logprobs"].tolist()) == len(PHRASE) - 1
        )
        assert all(key.count(":") == 1 for key in out.metrics), out.metrics
    step = training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    assert step.metrics is not None
    for _ in range(5):  # forward_backward and optim_step submitted before either is awaited
        fb = training.forward_backward([sft(PHRASE)], "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=5e-3))
        fb.result(), opt.result()
    after = float(
        np.mean(
            training.forward([sft(PHRASE)], "cross_entropy")
            .result()
            .loss_fn_outputs[0]["logprobs"]
            .to_numpy()
        )
    )
    assert after > start + 0.5, (start, after)

    # sampling from the trained weights
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(PHRASE[:6])
    result = sampler.sample(
        prompt,
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, stop=[]),
    ).result()
    assert len(result.sequences) == 2 and all(len(s.tokens) == 6 for s in result.sequences)
    assert all(s.sequence_id for s in result.sequences)
    prompt_logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(PHRASE)).result()
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(PHRASE)
    trained = (
        training.forward([sft(PHRASE)], "cross_entropy")
        .result()
        .loss_fn_outputs[0]["logprobs"]
        .tolist()
    )
    np.testing.assert_allclose(
        prompt_logprobs[1:], trained, atol=1e-4
    )  # the sampler has the adapter

    # save_state, more training, load_state with the optimizer: back where the state was
    saved = training.save_state("step-6").result().path
    assert saved == f"tinker://{training.model_id}/weights/step-6"
    at_save = (
        training.forward([sft(PHRASE)], "cross_entropy")
        .result()
        .loss_fn_outputs[0]["logprobs"]
        .tolist()
    )
    training.forward_backward([sft(PHRASE[::-1])], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    moved = (
        training.forward([sft(PHRASE)], "cross_entropy")
        .result()
        .loss_fn_outputs[0]["logprobs"]
        .tolist()
    )
    assert not np.allclose(moved, at_save, atol=1e-4)
    training.load_state_with_optimizer(saved).result()
    back = (
        training.forward([sft(PHRASE)], "cross_entropy")
        .result()
        .loss_fn_outputs[0]["logprobs"]
        .tolist()
    )
    np.testing.assert_allclose(back, at_save, atol=1e-5)

    # a new training client from the state, optimizer included: it continues as the first does
    resumed = service_client.create_training_client_from_state_with_optimizer(saved).result()
    assert resumed.model_id != training.model_id
    for client in (training, resumed):
        client.forward_backward([sft(PHRASE)], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    np.testing.assert_allclose(
        resumed.forward([sft(PHRASE)], "cross_entropy")
        .result()
        .loss_fn_outputs[0]["logprobs"]
        .tolist(),
        training.forward([sft(PHRASE)], "cross_entropy")
        .result()
        .loss_fn_outputs[0]["logprobs"]
        .tolist(),
        atol=1e-5,
    )

    # REST: the run and its checkpoint are listed, and a checkpoint can be deleted
    rest = service_client.create_rest_client()
    run = rest.get_training_run(training.model_id).result()
    assert run.base_model == BASE and run.model_owner == "alice" and run.lora_rank == 8
    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [saved]
    rest.delete_checkpoint_from_tinker_path(saved).result()
    assert rest.list_checkpoints(training.model_id).result().checkpoints == []
    with pytest.raises(Exception, match="not found"):
        service_client.create_training_client_from_state(saved).result()


def test_named_sampler_weights_serve_a_sampling_client_by_path(
    service_client, base_model: str, tinker_server
) -> None:
    """Sampling from saved sampler weights; deleting them closes the engine that served them."""
    BASE = base_model
    training = service_client.create_lora_training_client(base_model=BASE, rank=4).result()
    for _ in range(4):
        training.forward_backward([sft(PHRASE)], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-2))
    path = training.save_weights_for_sampler("final").result().path
    assert path.endswith("/sampler_weights/final")
    by_path = service_client.create_sampling_client(model_path=path)
    base = service_client.create_sampling_client(base_model=BASE)
    tokens = types.ModelInput.from_ints(PHRASE)
    trained, untrained = (
        np.nansum(np.array(c.compute_logprobs(tokens).result()[1:], dtype=float))
        for c in (by_path, base)
    )
    assert trained > untrained + 1.0
    engines = tinker_server[1].service._engines
    assert any(str(weights).endswith("sampler_weights/final") for _, weights in engines)
    service_client.create_rest_client().delete_checkpoint_from_tinker_path(path).result()
    assert not any(str(weights).endswith("sampler_weights/final") for _, weights in engines)


def test_bad_requests_fail_their_own_call_and_nothing_else(service_client, base_model: str) -> None:
    BASE = base_model
    training = service_client.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(Exception, match="target_tokens"):
        training.forward_backward(
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"weights": [1.0, 1.0, 1.0]},
                )
            ],
            "cross_entropy",
        ).result()
    with pytest.raises(Exception, match=r"151936|vocab"):
        training.forward([sft([1, 2, 10**7])], "cross_entropy").result()
    with pytest.raises(Exception, match="not served"):
        service_client.create_lora_training_client(base_model="no/such-model", rank=4).result()
    assert len(training.forward([sft(PHRASE)], "cross_entropy").result().loss_fn_outputs) == 1


def test_a_tenant_cannot_reach_another_tenants_runs(
    tinker_url: str, service_client, base_model: str, api_keys: dict[str, str]
) -> None:
    BASE, KEYS = base_model, api_keys
    alice = service_client.create_lora_training_client(base_model=BASE, rank=4).result()
    saved = alice.save_state("mine").result().path
    with tinker.ServiceClient(base_url=tinker_url, api_key=KEYS["bob"]) as bob:
        rest = bob.create_rest_client()
        assert all(r.model_owner == "bob" for r in rest.list_training_runs().result().training_runs)
        for attempt in (
            lambda: rest.get_training_run(alice.model_id).result(),
            lambda: rest.list_checkpoints(alice.model_id).result(),
            lambda: rest.delete_checkpoint_from_tinker_path(saved).result(),
            lambda: bob.create_training_client_from_state(saved).result(),
            lambda: (
                bob.create_sampling_client(model_path=saved)
                .sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=1))
                .result()
            ),
        ):
            with pytest.raises(Exception, match="not found"):
                attempt()
    with pytest.raises(Exception, match="unknown API key"):
        tinker.ServiceClient(base_url=tinker_url, api_key="tml-nobody").create_lora_training_client(
            base_model=BASE, rank=4
        ).result()
    assert alice.forward([sft(PHRASE)], "cross_entropy").result().loss_fn_outputs


def test_a_call_split_into_chunks_comes_back_whole_and_in_order(
    service_client, base_model: str
) -> None:
    """Over 1024 datums the SDK sends chunks concurrently, the first one last; the server runs
    them in seq_id order and the SDK joins the results."""
    training = service_client.create_lora_training_client(base_model=base_model, rank=4).result()
    data = [sft([7 + i % 50, 100 + i, 3]) for i in range(1100)]
    out = training.forward(data, "cross_entropy").result()
    assert len(out.loss_fn_outputs) == 1100
    alone = training.forward([data[1050]], "cross_entropy").result()
    np.testing.assert_allclose(
        out.loss_fn_outputs[1050]["logprobs"].tolist(),
        alone.loss_fn_outputs[0]["logprobs"].tolist(),
        atol=1e-5,
    )


@pytest.mark.slow  # 7 s of training four runs: with the slow tests (make check < 5 min)
def test_concurrent_runs_share_passes_and_learn_as_if_alone(tinker_server, base_model: str) -> None:
    """Three clients training at once: their forward_backward calls share passes (all three in
    most), their optim_step calls share calls on the trainer's thread, and each run's losses are
    those of the same run trained alone."""
    import threading

    url, app = tinker_server
    keys = "tml-alice-key"

    def train(seed: int, losses: list[float], barrier: threading.Barrier | None) -> None:
        with tinker.ServiceClient(base_url=url, api_key=keys) as client:
            run = client.create_lora_training_client(
                base_model=base_model, rank=4, seed=seed
            ).result()
            rng = np.random.default_rng(seed)
            data = [
                sft(rng.integers(100, 5000, size=int(rng.integers(6, 14))).tolist())
                for _ in range(3)
            ]
            if barrier:
                barrier.wait()
            for _ in range(
                4
            ):  # the step as the SDK's docs write it: both requests, then the results
                out = run.forward_backward(data, "cross_entropy")
                run.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                losses.append(out.result().metrics["loss:sum"])

    alone: list[list[float]] = [[] for _ in range(3)]
    for seed in range(3):
        train(seed, alone[seed], None)
    batcher = app.service.batchers[base_model]
    passes, calls, steps = batcher.passes, batcher.calls, batcher.step_batches
    together: list[list[float]] = [[] for _ in range(3)]
    barrier = threading.Barrier(3)
    threads = [
        threading.Thread(target=train, args=(seed, together[seed], barrier)) for seed in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    np.testing.assert_allclose(together, alone, rtol=1e-4)
    assert batcher.calls - calls == 12 and batcher.passes - passes <= 6, batcher.passes - passes
    assert batcher.step_batches - steps <= 6, batcher.step_batches - steps


CRASHING_CLIENT = """
import sys, tinker
url, key, base = sys.argv[1:]
with tinker.ServiceClient(base_url=url, api_key=key) as client:
    run = client.create_lora_training_client(base_model=base, rank=4).result()
    datum = tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(list(range(100, 140))),
        loss_fn_inputs={"target_tokens": list(range(101, 141)), "weights": [1.0] * 40},
    )
    while True:
        run.forward_backward([datum] * 4, "cross_entropy")
        run.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result()
        print(run.model_id, flush=True)
"""


@pytest.mark.slow  # 25 s, killing and recovering: with the slow tests (make check < 5 min)
def test_a_tenant_killed_mid_run_leaves_the_others_training(
    tinker_server, base_model: str, api_keys: dict[str, str], service_client
) -> None:
    """Bob's training program is SIGKILLed while its requests are in flight: Alice's run goes on
    undisturbed, and Bob's run is unloaded once his session stops sending heartbeats."""
    import subprocess
    import sys
    import time

    url, app = tinker_server
    alice = service_client.create_lora_training_client(base_model=base_model, rank=4).result()
    bob = subprocess.Popen(
        [sys.executable, "-c", CRASHING_CLIENT, url, api_keys["bob"], base_model],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        bob_run = bob.stdout.readline().strip()  # type: ignore[union-attr]
        assert bob_run.endswith(":train:0"), bob_run
    finally:
        bob.kill()
        bob.wait(30)
    for _ in range(3):
        alice.forward_backward([sft(PHRASE)], "cross_entropy").result()
        alice.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    deadline = time.monotonic() + 90
    while app.service.runs[bob_run].engine is not None:
        assert time.monotonic() < deadline, "the killed client's run was never unloaded"
        time.sleep(1)
    assert app.service.runs[alice.model_id].engine is not None
    assert alice.forward([sft(PHRASE)], "cross_entropy").result().loss_fn_outputs
