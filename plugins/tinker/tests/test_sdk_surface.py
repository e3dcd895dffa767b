"""Every public method of the tinker 0.38 SDK's clients is served by `plait serve tinker`, or
refused at once with "not served by plait" and listed under "Not served" in the README, or makes
no request at all. A method the SDK adds fails this test until it is sorted."""

from __future__ import annotations

import inspect
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
types = tinker.types

pytestmark = pytest.mark.timeout(300)

README = Path(__file__).parents[1] / "README.md"
PHRASE = [1000 + 37 * i for i in range(12)]
CLIENTS = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")


@attrs.define
class Clients:
    service: Any
    rest: Any
    training: Any
    sampling: Any
    state: str  # a saved state's tinker path
    sampler_weights: str
    api_key: str


def sft() -> Any:
    return types.Datum(
        model_input=types.ModelInput.from_ints(PHRASE[:-1]),
        loss_fn_inputs={"target_tokens": PHRASE[1:], "weights": [1.0] * (len(PHRASE) - 1)},
    )


def custom_loss(data: list[Any], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
    loss = sum(
        -(lp * d.loss_fn_inputs["weights"].to_torch()).sum()
        for d, lp in zip(data, logprobs, strict=True)
    )
    return loss, {"custom": float(loss)}


def neg_ll(logprobs: Any, weights: Any) -> tuple[Any, dict[str, Any]]:
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


def _checkpoint(path: str) -> tuple[str, str]:
    """(training run id, checkpoint id) of a tinker path."""
    run, kind, name = path.removeprefix("tinker://").split("/")
    return run, f"{kind}/{name}"


PROMPT = types.ModelInput.from_ints(PHRASE[:6])
PARAMS = types.SamplingParams(max_tokens=2, temperature=1.0)

# Each served method, called the smallest way that exercises its route.
SERVED: dict[str, Callable[[Clients], Any]] = {
    "ServiceClient.close": lambda c: None,  # the fixture closes the client: it must not fail
    "ServiceClient.create_custom_loss": lambda c: c.training.forward_backward_custom(
        [sft()],
        c.service.create_custom_loss(neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result(),
    ).result(),  # runs on the client (custom_loss_server_side is off) over a served forward
    "ServiceClient.create_lora_training_client": lambda c: c.training.get_info(),
    "ServiceClient.create_sampling_client": lambda c: c.service.create_sampling_client(
        base_model=c.training.get_info().model_data.model_name
    ).result(),
    "ServiceClient.create_training_client_from_state": lambda c: (
        c.service.create_training_client_from_state(c.state).result()
    ),
    "ServiceClient.create_training_client_from_state_with_optimizer": lambda c: (
        c.service.create_training_client_from_state_with_optimizer(c.state).result()
    ),
    "ServiceClient.get_server_capabilities": lambda c: c.service.get_server_capabilities(),
    "TrainingClient.create_sampling_client": lambda c: c.training.create_sampling_client(
        c.sampler_weights
    ).result(),
    "TrainingClient.forward": lambda c: c.training.forward([sft()], "cross_entropy").result(),
    "TrainingClient.forward_backward": lambda c: c.training.forward_backward(
        [sft()], "cross_entropy"
    ).result(),
    "TrainingClient.forward_backward_custom": lambda c: c.training.forward_backward_custom(
        [sft()], custom_loss
    ).result(),
    "TrainingClient.get_info": lambda c: c.training.get_info(),
    "TrainingClient.get_tokenizer": lambda c: c.training.get_tokenizer().encode("hello"),
    "TrainingClient.load_state": lambda c: c.training.load_state(c.state).result(),
    "TrainingClient.load_state_with_optimizer": lambda c: c.training.load_state_with_optimizer(
        c.state
    ).result(),
    "TrainingClient.optim_step": lambda c: c.training.optim_step(
        types.AdamParams(learning_rate=1e-4)
    ).result(),
    "TrainingClient.save_state": lambda c: c.training.save_state(f"s{time.time_ns()}").result(),
    "TrainingClient.save_weights_and_get_sampling_client": lambda c: (
        c.training.save_weights_and_get_sampling_client().result().sample(PROMPT, 1, PARAMS)
    ).result(),
    "TrainingClient.save_weights_for_sampler": lambda c: c.training.save_weights_for_sampler(
        f"w{time.time_ns()}"
    ).result(),
    "SamplingClient.compute_logprobs": lambda c: c.sampling.compute_logprobs(PROMPT).result(),
    "SamplingClient.create": lambda c: c.service.create_sampling_client(
        model_path=c.sampler_weights
    ).result(),  # what every create_sampling_client calls
    "SamplingClient.from_sampler_handle": lambda c: tinker.SamplingClient.from_sampler_handle(
        c.sampling.get_sampler_handle(), api_key=c.api_key
    ),
    "SamplingClient.sample": lambda c: c.sampling.sample(PROMPT, 2, PARAMS).result(),
    "RestClient.delete_checkpoint": lambda c: c.rest.delete_checkpoint(
        *_checkpoint(c.training.save_state(f"d{time.time_ns()}").result().path)
    ).result(),
    "RestClient.delete_checkpoint_from_tinker_path": lambda c: (
        c.rest.delete_checkpoint_from_tinker_path(
            c.training.save_state(f"d{time.time_ns()}").result().path
        ).result()
    ),
    "RestClient.get_sampler": lambda c: c.rest.get_sampler(
        c.sampling._sampling_session_id  # the sampler's id; the SDK has no public accessor
    ).result(),
    "RestClient.get_server_capabilities": lambda c: c.rest.get_server_capabilities().result(),
    "RestClient.get_session": lambda c: c.rest.get_session(
        c.training.model_id.split(":")[0]
    ).result(),
    "RestClient.get_training_run": lambda c: c.rest.get_training_run(c.training.model_id).result(),
    "RestClient.get_training_run_by_tinker_path": lambda c: c.rest.get_training_run_by_tinker_path(
        c.state
    ).result(),
    "RestClient.get_weights_info_by_tinker_path": lambda c: c.rest.get_weights_info_by_tinker_path(
        c.state
    ).result(),
    "RestClient.list_checkpoints": lambda c: c.rest.list_checkpoints(c.training.model_id).result(),
    "RestClient.list_sessions": lambda c: c.rest.list_sessions().result(),
    "RestClient.list_training_runs": lambda c: c.rest.list_training_runs().result(),
    "RestClient.list_user_checkpoints": lambda c: c.rest.list_user_checkpoints().result(),
    "RestClient.publish_checkpoint_from_tinker_path": lambda c: (
        c.rest.publish_checkpoint_from_tinker_path(c.state).result()
    ),
    "RestClient.unpublish_checkpoint_from_tinker_path": lambda c: (
        c.rest.unpublish_checkpoint_from_tinker_path(c.state).result()
    ),
    "RestClient.set_checkpoint_ttl_from_tinker_path": lambda c: (
        c.rest.set_checkpoint_ttl_from_tinker_path(c.state, 3600).result()
    ),
}

# Hosted-Tinker features: each call must be refused at once, naming itself as not served.
NOT_SERVED: dict[str, Callable[[Clients], Any]] = {
    "ServiceClient.copy_weights": lambda c: c.service.copy_weights(c.state).result(),
    "TrainingClient.save_weights_external": lambda c: c.training.save_weights_external(
        "x"
    ).result(),
    "RestClient.assign_session_project": lambda c: c.rest.assign_session_project("s", "p").result(),
    "RestClient.copy_weights": lambda c: c.rest.copy_weights(c.state, "project").result(),
    "RestClient.export_session_trace": lambda c: c.rest.export_session_trace("s").result(),
    "RestClient.get_audit_log": lambda c: c.rest.get_audit_log().result(),
    "RestClient.get_billing_usage": lambda c: c.rest.get_billing_usage(
        "2026-01-01", "2026-02-01"
    ).result(),
    "RestClient.get_current_checkpoint_storage_usage": lambda c: (
        c.rest.get_current_checkpoint_storage_usage().result()
    ),
    "RestClient.get_external_weights_urls": lambda c: c.rest.get_external_weights_urls(
        c.state.replace("/weights/", "/external_weights/")
    ).result(),
    "RestClient.search_sessions": lambda c: c.rest.search_sessions(
        types.SessionSearchRequest()
    ).result(),
}

# Methods that send nothing to the server.
LOCAL = {
    "ServiceClient.create_rest_client",  # deprecated: builds a RestClient
    "ServiceClient.get_console_url",  # a URL of the hosted console
    "TrainingClient.get_console_url",
    "SamplingClient.get_sampler_handle",
    "SamplingClient.get_base_model",
    "SamplingClient.on_queue_state_change",
    "SamplingClient.get_tokenizer",  # loads by the base model's name: see the README
    "RestClient.whoami",  # decodes a JWT credential; with plain keys the SDK raises at once
    *(f"{client}.get_telemetry" for client in CLIENTS),
}


def public_methods() -> set[str]:
    return {
        f"{client}.{name}"
        for client in CLIENTS
        for name, value in inspect.getmembers(getattr(tinker, client))
        if not name.startswith("_") and callable(value) and not name.endswith("_async")
    }


def test_every_public_method_is_sorted() -> None:
    methods = public_methods()
    sorted_ = set(SERVED) | set(NOT_SERVED) | LOCAL
    assert methods - sorted_ == set(), "new SDK methods: serve them or list them as not served"
    assert sorted_ - methods == set(), "these are no longer in the SDK"


def test_the_readme_lists_exactly_what_is_not_served() -> None:
    section = README.read_text().split("**Not served**", 1)[1].split("\n\n", 1)[0]
    listed = set(re.findall(r"`(\w+Client\.\w+)`", section))
    assert listed == set(NOT_SERVED)


@pytest.fixture(scope="module")
def clients(tinker_url: str, base_model: str, api_keys: dict[str, str]):
    with tinker.ServiceClient(base_url=tinker_url, api_key=api_keys["alice"]) as service:
        training = service.create_lora_training_client(base_model=base_model, rank=4).result()
        state = training.save_state("surface").result().path
        sampler_weights = training.save_weights_for_sampler("surface").result().path
        c = Clients(
            service,
            tinker.RestClient(base_url=tinker_url, api_key=api_keys["alice"]),
            training,
            training.create_sampling_client(sampler_weights).result(),
            state,
            sampler_weights,
            api_keys["alice"],
        )
        yield c


@pytest.mark.parametrize("method", sorted(SERVED))
def test_served(clients: Clients, method: str) -> None:
    SERVED[method](clients)


@pytest.mark.parametrize("method", sorted(NOT_SERVED))
def test_refused_at_once_as_not_served(
    clients: Clients, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINKER_PROJECT_ID", "project")  # ServiceClient.copy_weights asks first
    began = time.monotonic()
    with pytest.raises(Exception, match="not served by plait"):
        NOT_SERVED[method](clients)
    assert time.monotonic() - began < 5.0  # not retried


def test_a_published_checkpoint_loads_for_another_tenant(
    clients: Clients, tinker_url: str, api_keys: dict[str, str]
) -> None:
    rest = clients.rest
    with tinker.ServiceClient(base_url=tinker_url, api_key=api_keys["bob"]) as bob:
        with pytest.raises(tinker.NotFoundError):
            bob.create_training_client_from_state(clients.state).result()
        rest.publish_checkpoint_from_tinker_path(clients.state).result()
        run = bob.create_training_client_from_state(clients.state).result()
        assert run.forward([sft()], "cross_entropy").result().loss_fn_outputs
        info = tinker.RestClient(base_url=tinker_url, api_key=api_keys["bob"])
        assert info.get_weights_info_by_tinker_path(clients.state).result().lora_rank == 4
        with pytest.raises(tinker.NotFoundError):  # to load, not to change
            info.delete_checkpoint_from_tinker_path(clients.state).result()
        rest.unpublish_checkpoint_from_tinker_path(clients.state).result()
        with pytest.raises(tinker.NotFoundError):
            bob.create_training_client_from_state(clients.state).result()


def test_a_checkpoint_expires_with_its_ttl(clients: Clients, tinker_server) -> None:
    import asyncio

    path = clients.training.save_state(f"ttl{time.time_ns()}").result().path
    clients.rest.set_checkpoint_ttl_from_tinker_path(path, 1).result()
    expires = clients.rest.list_checkpoints(clients.training.model_id).result()
    assert any(c.tinker_path == path and c.expires_at for c in expires.checkpoints)
    time.sleep(1.1)
    asyncio.run(tinker_server[1].service.expire_checkpoints())  # what the server does each 5 s
    with pytest.raises(tinker.NotFoundError):
        clients.rest.get_weights_info_by_tinker_path(path).result()


def test_prompt_logprobs_of_the_last_n_tokens(clients: Clients) -> None:
    whole = clients.sampling.compute_logprobs(types.ModelInput.from_ints(PHRASE)).result()
    last = (
        clients.sampling.sample(
            types.ModelInput.from_ints(PHRASE),
            1,
            types.SamplingParams(max_tokens=1),
            include_prompt_logprobs=True,
            prompt_logprobs_last_n=3,
        )
        .result()
        .prompt_logprobs
    )
    assert last[:-3] == [None] * (len(PHRASE) - 3)
    np.testing.assert_allclose(last[-3:], whole[-3:], atol=1e-5)


def test_top_k_logprobs_of_each_sampled_token(clients: Clients) -> None:
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    result = clients.sampling.sample(PROMPT, 1, greedy, topk_sample_logprobs=3).result()
    sequence = result.sequences[0]
    top = sequence.topk_logprobs
    assert top is not None and len(top) == len(sequence.tokens) == 4
    for token, logprob, candidates in zip(sequence.tokens, sequence.logprobs, top, strict=True):
        assert len(candidates) == 3 and candidates[0][0] == token  # greedy: the most likely
        assert abs(candidates[0][1] - logprob) < 1e-5
        assert candidates[0][1] >= candidates[1][1] >= candidates[2][1]
