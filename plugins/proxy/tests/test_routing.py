"""Routing replay (R3) through the proxy: in front of plait-torch on a mixture-of-experts model that
samples with `enable_return_routed_experts`, every recorded choice keeps the routing the engine
returned, a client stop string cuts it with the tokens, the session's training datums carry it
position for position, and the rollout store's record keeps it (compactly)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plait.api import (
    Message,
    ModelInput,
    ResolvedModel,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    TensorData,
    ToolCall,
    ToolSpec,
    from_json,
    get_registry,
    to_json,
)
from plait.trajectory import Trajectory, Turn
from plait_algorithms.datums import merge_turns, trajectory_to_datums
from plait_proxy.chat import ChatRequest
from plait_proxy.proxy import Proxy, _cut_at_stop_string
from plait_proxy.store import RolloutStore

pytest.importorskip("plait_qwen", reason="needs the Qwen renderers (plait-qwen)")

LAYERS, TOP_K, EXPERTS = 2, 2, 8
QUESTION = [Message("system", "You are terse."), Message("user", "What is 7*6?")]
CALCULATOR = ToolSpec(
    "calculator",
    "Evaluate an arithmetic expression.",
    {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
)


@pytest.fixture(scope="module")
def tool_calling_moe(
    tool_calling_qwen3: tuple[ResolvedModel, list[int]],
) -> tuple[ResolvedModel, list[int]]:
    """tool-calling-qwen3 upcycled into a Qwen3-MoE (8 identical experts, 2 per token, random
    routers): it writes the same tool call, and its routers pick experts token by token."""
    upcycle = pytest.importorskip("plait_torch.models").upcycle_qwen3_moe
    dense, script = tool_calling_qwen3
    dest = dense.path.parent / "tool-calling-qwen3-moe"
    if not dest.exists():
        upcycle(
            dense.path,
            dest,
            num_experts=EXPERTS,
            top_k=TOP_K,
            expert_noise=0.0,
            router_std=1.0,
            seed=0,
        )
    return ResolvedModel("tool-calling-qwen3-moe", dest, dest), script


class Recording:
    """The engine, keeping every sequence it returned."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.returned: list[SampledSequence] = []

    async def sample(
        self, prompt: ModelInput, num_samples: int, sampling: SamplingParams, **kw: Any
    ) -> SampleResponse:
        response = await self.engine.sample(prompt, num_samples, sampling, **kw)
        self.returned += response.sequences
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def make_proxy(model: ResolvedModel) -> tuple[Proxy, Recording]:
    from plait_torch.options import TorchInferenceOptions

    registry = get_registry()
    engine = Recording(
        registry.get("inference_engine", "torch").load()(
            model,
            options=TorchInferenceOptions(device="cpu", enable_return_routed_experts=True),
            seed=0,
        )
    )
    renderer = registry.get("renderer", "qwen3_keep_reasoning").load()(model, options=None)
    return Proxy(engine, renderer, model.name), engine  # type: ignore[arg-type]


def ask(messages: list[Message], **fields: Any) -> ChatRequest:
    return ChatRequest(
        model="m",
        messages=messages,
        tools=[CALCULATOR],
        **{"max_tokens": 64, "temperature": 0.0, **fields},
    )


def reference_routing(model: ResolvedModel, tokens: list[int]) -> np.ndarray:
    """The experts (sorted per layer) that an unbatched float32 forward over `tokens` routes."""
    import torch
    from transformers import AutoModelForCausalLM

    from plait_train.routing import RoutingHooks

    hf = AutoModelForCausalLM.from_pretrained(
        str(model.path), dtype=torch.float32, local_files_only=True
    ).eval()
    hooks = RoutingHooks(hf)
    with torch.no_grad():
        hf(torch.tensor([tokens]), use_cache=False)
    return np.sort(hooks.stacked(hooks.chosen).numpy(), axis=-1)


def check_shape(sequence: SampledSequence, prompt_length: int) -> np.ndarray:
    routing = sequence.routed_experts
    assert routing is not None and routing.dtype == "uint8"
    assert routing.shape == (prompt_length + len(sequence.tokens) - 1, LAYERS, TOP_K)
    return routing.to_numpy()


def test_a_tool_session_records_the_engines_routing_and_its_datum_covers_every_position(
    tool_calling_moe: tuple[ResolvedModel, list[int]], tmp_path: Path
) -> None:
    model, script = tool_calling_moe
    proxy, engine = make_proxy(model)
    store = RolloutStore(directory=tmp_path)

    async def go() -> Any:
        session = store.get("episode")
        messages = list(QUESTION)
        try:
            for _ in range(3):
                answer = (
                    (await proxy.complete(session, ask(messages), "openai_chat")).choices[0].message
                )
                assert answer.tool_calls, "the scripted model calls the calculator every turn"
                messages += [
                    Message(
                        "assistant",
                        answer.content,
                        tool_calls=[
                            ToolCall(c.name, c.arguments, "client-id") for c in answer.tool_calls
                        ],
                    ),
                    Message("tool", "42", tool_call_id="client-id"),
                ]
        finally:
            await proxy.engine.close()
        return store.finish("episode")

    session = asyncio.run(asyncio.wait_for(go(), 300))
    assert [c.prompt_source for c in session.calls] == ["render", "bridge", "bridge"]
    assert len(engine.returned) == 3
    for call, returned in zip(session.calls, engine.returned, strict=True):
        (choice,) = call.choices
        assert list(choice.sequence.tokens) == script
        check_shape(choice.sequence, len(call.prompt_ids))
        assert (
            choice.sequence.routed_experts == returned.routed_experts
        )  # stored as the engine returned it

    # One training sequence: the last turn's routing covers every position of the datum.
    turns = session.turns()
    assert len(merge_turns(turns)) == 1
    (datum,) = trajectory_to_datums(Trajectory(task={}, turns=turns), 1.0)
    routed = datum.loss_fn_inputs["routed_experts"]
    assert routed.shape == (datum.model_input.length, LAYERS, TOP_K) and routed.dtype == "uint8"
    assert routed == turns[-1].completion.routed_experts
    np.testing.assert_array_equal(
        np.sort(routed.to_numpy(), axis=-1), reference_routing(model, datum.model_input.to_ints())
    )

    # The record in sessions.jsonl keeps every choice's routing, compactly, and reads back equal.
    (line,) = (tmp_path / "sessions.jsonl").read_text().splitlines()
    record = json.loads(line)
    for call, stored in zip(session.calls, record["calls"], strict=True):
        encoded = stored["choices"][0]["routed_experts"]
        assert set(encoded) == {"dtype", "shape", "base64"} and encoded["dtype"] == "uint8"
        assert from_json(TensorData, encoded) == call.choices[0].sequence.routed_experts
    assert len(line) < 4 * sum(
        len(c.choices[0].sequence.routed_experts.data) for c in session.calls
    )


def test_a_stop_string_cuts_the_routing_with_the_tokens(
    tool_calling_moe: tuple[ResolvedModel, list[int]],
) -> None:
    model, script = tool_calling_moe
    proxy, engine = make_proxy(model)

    async def go() -> Any:
        try:
            return await proxy.complete(
                RolloutStore().get("s"), ask(QUESTION, stop=["calcul"]), "openai_chat"
            )
        finally:
            await proxy.engine.close()

    completion = asyncio.run(asyncio.wait_for(go(), 300))
    (choice,) = completion.choices
    (returned,) = engine.returned
    kept = len(choice.sequence.tokens)
    assert (
        choice.stop_string == "calcul"
        and list(choice.sequence.tokens) == script[:kept]
        and kept < len(script)
    )
    routing = check_shape(choice.sequence, len(completion.prompt_ids))
    np.testing.assert_array_equal(routing, returned.routed_experts.to_numpy()[: len(routing)])
    (datum,) = trajectory_to_datums(
        Trajectory(task={}, turns=[Turn(completion.prompt_ids, choice.sequence)]), 1.0
    )
    assert datum.loss_fn_inputs["routed_experts"].shape[0] == datum.model_input.length


def test_cutting_keeps_the_dtype_and_a_sequence_without_routing() -> None:
    def decode(ids: list[int]) -> str:  # token i is the character chr(i)
        return "".join(map(chr, ids))

    tokens = [ord(c) for c in "abcSTOPdef"]
    prompt = 4
    routing = TensorData.compact(
        np.arange((prompt + len(tokens) - 1) * 2 * 2).reshape(-1, 2, 2) + 210
    )
    assert routing.dtype == "uint16" and routing.to_numpy()[: prompt + 7 - 1].max() < 256
    sequence = SampledSequence(tokens, [0.0] * len(tokens), "length", routed_experts=routing)
    cut, stop = _cut_at_stop_string(sequence, ["STOP"], decode)
    assert stop == "STOP" and len(cut.tokens) == 7
    assert (
        cut.routed_experts is not None and cut.routed_experts.dtype == "uint16"
    )  # not re-narrowed
    np.testing.assert_array_equal(
        cut.routed_experts.to_numpy(), routing.to_numpy()[: prompt + 7 - 1]
    )
    plain, _ = _cut_at_stop_string(
        SampledSequence(tokens, [0.0] * len(tokens), "length"), ["STOP"], decode
    )
    assert plain.routed_experts is None


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32", "int64", "float32"])
def test_tensor_json_round_trips(dtype: str) -> None:
    tensor = TensorData.from_list(np.arange(5 * 2 * 3).reshape(5, 2, 3).tolist(), dtype)  # type: ignore[arg-type]
    encoded = json.loads(json.dumps(to_json(tensor)))
    assert from_json(TensorData, encoded) == tensor
    empty = TensorData.compact(np.zeros((0, 2, 2), dtype=np.int64))
    assert from_json(TensorData, to_json(empty)) == empty
