"""The proxy core against the reference engine (plait-torch) and the Qwen3 renderers: the ids
recorded are the ids sampled, conversations a client echoes back continue the sampled ids
verbatim, and sessions become the trajectories the trainer reads."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from plait.api import Message, SamplingParams, ToolCall, ToolSpec, get_registry
from plait.trajectory import Trajectory
from plait_algorithms.datums import merge_turns, trajectory_to_datums
from plait_proxy.chat import ChatRequest, RequestError
from plait_proxy.proxy import Limits, Proxy
from plait_proxy.store import RolloutStore, SessionPolicy

pytest.importorskip("plait_qwen", reason="needs the Qwen renderers (plait-qwen)")

CALCULATOR = ToolSpec(
    "calculator",
    "Evaluate an arithmetic expression.",
    {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
)
QUESTION = [Message("system", "You are terse."), Message("user", "What is 7*6?")]


def make_proxy(model: Any, renderer: str = "qwen3_keep_reasoning", **limits: int) -> Proxy:
    registry = get_registry()
    engine = registry.get("inference_engine", "torch").load()(model, options=None, seed=0)
    return Proxy(
        engine,
        registry.get("renderer", renderer).load()(model, options=None),
        model.name,
        Limits(**limits) if limits else None,
    )


def ask(messages: list[Message], **fields: Any) -> ChatRequest:
    return ChatRequest(
        model="m",
        messages=messages,
        tools=[CALCULATOR],
        **{"max_tokens": 64, "temperature": 0.0, **fields},
    )


def echoed(message: Message) -> Message:
    """The assistant message as a client sends it back: no reasoning, its own tool-call ids."""
    return Message(
        "assistant",
        message.content,
        tool_calls=[ToolCall(c.name, c.arguments, "client-id") for c in message.tool_calls],
    )


def tool_session(proxy: Proxy, turns: int) -> Any:
    """A client that runs the calculator on every tool call, for `turns` model calls."""
    store = RolloutStore()

    async def go() -> Any:
        session = store.get("episode")
        messages = list(QUESTION)
        for _ in range(turns):
            completion = await proxy.complete(session, ask(messages), "openai_chat")
            answer = completion.choices[0].message
            messages += [
                echoed(answer),
                *(Message("tool", "42", tool_call_id="client-id") for _ in answer.tool_calls),
            ]
        await proxy.engine.close()
        return store.finish("episode")

    return asyncio.run(asyncio.wait_for(go(), 300))


def sampled_ids_in(trajectory: Trajectory) -> list[int]:
    ids: list[int] = []
    for datum in trajectory_to_datums(trajectory, 1.0):
        mask = datum.loss_fn_inputs["mask"].to_numpy().astype(bool)
        ids += datum.loss_fn_inputs["target_tokens"].to_numpy()[mask].tolist()
    return ids


def test_tool_calls_are_parsed_and_every_sampled_id_is_recorded(tool_calling_qwen3: Any) -> None:
    model, script = tool_calling_qwen3
    session = tool_session(make_proxy(model), turns=1)
    (call,) = session.calls
    (choice,) = call.choices
    assert list(choice.sequence.tokens) == script  # the engine's ids, not a re-tokenization
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "add them"
    (tool_call,) = choice.message.tool_calls
    assert (tool_call.name, tool_call.arguments) == (
        "calculator",
        {"expression": "7*6"},
    ) and tool_call.id


def test_a_multi_turn_tool_session_is_one_training_sequence_under_the_keep_reasoning_renderer(
    tool_calling_qwen3: Any,
) -> None:
    model, script = tool_calling_qwen3
    session = tool_session(make_proxy(model), turns=3)
    assert [c.parent for c in session.calls] == [None, (0, 0), (1, 0)]
    assert [c.prompt_source for c in session.calls] == ["render", "bridge", "bridge"]
    turns = session.turns()
    (segment,) = merge_turns(turns)
    assert segment.tokens == [*turns[-1].prompt, *turns[-1].completion.tokens]
    trajectory = Trajectory(task={}, turns=turns)
    assert sampled_ids_in(trajectory) == script * 3
    logprobs = [lp for t in turns for lp in t.completion.logprobs]
    (datum,) = trajectory_to_datums(trajectory, 1.0)
    mask = datum.loss_fn_inputs["mask"].to_numpy().astype(bool)
    assert np.allclose(datum.loss_fn_inputs["logprobs"].to_numpy()[mask], logprobs)


def test_a_renderer_that_rewrites_history_splits_the_sequence_at_every_turn(
    tool_calling_qwen3: Any,
) -> None:
    model, script = tool_calling_qwen3
    session = tool_session(make_proxy(model, "qwen3"), turns=2)
    assert [c.parent for c in session.calls] == [None, (0, 0)]  # it continues the answer ...
    assert [c.prompt_source for c in session.calls] == ["render", "render"]  # ... but re-rendered
    assert len(merge_turns(session.turns())) == 2
    assert sampled_ids_in(Trajectory(task={}, turns=session.turns())) == script * 2


def run_one(proxy: Proxy, request: ChatRequest, store: RolloutStore | None = None) -> Any:
    store = RolloutStore() if store is None else store

    async def go() -> Any:
        try:
            return await proxy.complete(store.get("s"), request, "openai_chat")
        finally:
            await proxy.engine.close()

    return asyncio.run(asyncio.wait_for(go(), 300))


def test_a_client_stop_string_cuts_the_sampled_ids_where_an_engine_would_have_stopped(
    tool_calling_qwen3: Any,
) -> None:
    model, script = tool_calling_qwen3
    proxy = make_proxy(model)
    completion = run_one(proxy, ask(QUESTION, stop=["calcul"]))
    (choice,) = completion.choices
    decode = proxy.renderer.tokenizer.decode
    tokens = list(choice.sequence.tokens)
    assert (
        tokens == script[: len(tokens)]
        and "calcul" in decode(tokens)
        and "calcul" not in decode(tokens[:-1])
    )
    assert choice.finish_reason == "stop" and choice.stop_string == "calcul"
    assert "calcul" not in choice.message.content and not choice.message.tool_calls


def test_n_choices_are_sampled_and_recorded(tool_calling_qwen3: Any) -> None:
    model, script = tool_calling_qwen3
    store = RolloutStore()
    completion = run_one(make_proxy(model), ask(QUESTION, n=3), store)
    assert [list(c.sequence.tokens) for c in completion.choices] == [script] * 3
    assert len(store.sessions["s"].calls[0].choices) == 3


def test_a_session_under_a_policy_samples_with_the_runs_settings_and_a_call_budget(
    tiny_qwen3: Any,
) -> None:
    proxy = make_proxy(tiny_qwen3)
    store = RolloutStore()
    session = store.open("episode")
    session.policy = SessionPolicy(
        SamplingParams(max_tokens=5, temperature=1.0, seed=3), max_calls=1
    )

    async def go() -> Any:
        try:
            first = await proxy.complete(
                session, ask(QUESTION, max_tokens=200, temperature=0.0), "openai_chat"
            )
            with pytest.raises(RequestError) as refused:
                await proxy.complete(session, ask(QUESTION), "openai_chat")
            return first, refused.value
        finally:
            await proxy.engine.close()

    first, refused = asyncio.run(asyncio.wait_for(go(), 300))
    assert len(first.choices[0].sequence.tokens) == 5  # the run's max_tokens, not the client's 200
    assert refused.status == 429 and session.policy_exhausted and len(session.calls) == 1


def test_a_prompt_past_the_context_is_refused_with_a_400(tiny_qwen3: Any) -> None:
    with pytest.raises(RequestError, match="maximum context length is 16 tokens") as refused:
        run_one(make_proxy(tiny_qwen3, max_context_tokens=16), ask(QUESTION))
    assert refused.value.status == 400


def test_a_cancelled_call_records_nothing(tiny_qwen3: Any) -> None:
    proxy = make_proxy(tiny_qwen3)
    store = RolloutStore()

    async def go() -> None:
        session = store.get("s")
        task = asyncio.ensure_future(
            proxy.complete(session, ask(QUESTION, max_tokens=2000, temperature=1.0), "openai_chat")
        )
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert session.calls == [] and session.in_flight == 0
        completion = await proxy.complete(
            session, ask(QUESTION, max_tokens=4), "openai_chat"
        )  # the engine goes on
        assert len(session.calls) == 1 and completion.choices[0].sequence.tokens
        await proxy.engine.close()

    asyncio.run(asyncio.wait_for(go(), 300))


def test_an_answer_cut_by_an_in_flight_weight_update_is_continued_with_the_new_weights(
    tiny_qwen3: Any,
) -> None:
    from safetensors.torch import load_file

    from plait.api import WeightUpdate

    proxy = make_proxy(tiny_qwen3)
    store = RolloutStore()
    weights = {
        name: t
        for f in sorted(tiny_qwen3.path.glob("*.safetensors"))
        for name, t in load_file(f).items()
    }

    async def go() -> Any:
        session = store.get("s")
        answer = asyncio.ensure_future(
            proxy.complete(
                session, ask(QUESTION, max_tokens=300, temperature=1.0, seed=1), "openai_chat"
            )
        )
        await asyncio.sleep(1.0)  # some tokens in (about 15 ms each)
        await proxy.engine.pause("abort")
        await proxy.engine.apply_weights(WeightUpdate(version=1, tensors=weights))
        await proxy.engine.resume()
        completion = await answer
        await proxy.engine.close()
        return session, completion

    session, completion = asyncio.run(asyncio.wait_for(go(), 300))
    sequence = completion.choices[0].sequence
    versions = sequence.versions()
    assert versions[0] == 0 and versions[-1] == 1 and list(versions) == sorted(versions), versions
    assert (
        len(sequence.tokens) == 300 or sequence.stop_reason == "stop"
    )  # not cut short by the update
    assert session.calls[0].choices[0].sequence == sequence


def test_the_harness_environment_starts_one_proxy_for_a_batch_of_episodes(
    tiny_qwen3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plait.api import EpisodeConfig
    from plait_proxy import harness
    from plait_proxy.harness import HarnessEnvironment, HarnessOptions

    started: list[Any] = []

    class CountedApp(harness.ProxyApp):
        def serving(self) -> Any:
            started.append(self)
            return super().serving()

    monkeypatch.setattr(harness, "ProxyApp", CountedApp)

    pytest.importorskip("plait_math", reason="the episodes' tasks come from math.arith")
    registry = get_registry()
    engine = registry.get("inference_engine", "torch").load()(tiny_qwen3, options=None, seed=0)
    renderer = registry.get("renderer", "qwen3_keep_reasoning").load()(tiny_qwen3, options=None)
    env = HarnessEnvironment(
        HarnessOptions(tasks="math.arith", function="plait_proxy.agents:openai_chat")
    )
    config = EpisodeConfig(SamplingParams(max_tokens=4, temperature=1.0, seed=0))

    async def go() -> list[Trajectory]:
        try:
            tasks = [await env.get_task("train", i) for i in range(6)]
            return list(
                await asyncio.gather(*(env.run_episode(t, engine, renderer, config) for t in tasks))
            )
        finally:
            await env.close()
            await engine.close()

    trajectories = asyncio.run(asyncio.wait_for(go(), 300))
    assert len(started) == 1 and not env.store.sessions  # one server; every session discarded
    for trajectory in trajectories:
        assert trajectory.error is None and trajectory.finished and len(trajectory.turns) == 1
        assert (
            len(trajectory.turns[0].completion.tokens) == 4
        )  # the run's max_tokens, not the client's
