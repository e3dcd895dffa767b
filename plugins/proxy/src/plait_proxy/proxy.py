"""The proxy: chat requests in, token ids through the engine, recorded completions out.

Token-in-token-out across an API that speaks text: a harness sends the whole conversation every
time, including the answers the proxy gave it. When a request's conversation is an earlier
call's conversation plus one of that call's answers plus new messages (tool results, a user
turn), the prompt is that call's prompt ids and sampled ids verbatim, continued by the
renderer's `bridge_to_next_turn` — so what the model is trained on is what it sampled, not a
re-tokenization of text the client echoed. Where the renderer declines (its template would show
the model something else) or nothing matches, the conversation is rendered afresh, and the
training sequence splits there (`plait_algorithms.datums.merge_turns` checks, never assumes).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence

import attrs

from plait.api import (
    InferenceEngine,
    Message,
    ModelInput,
    PromptSource,
    Renderer,
    RunConfig,
    SampledSequence,
    SamplingParams,
    TensorData,
    ToolCall,
    ToolSpec,
    sample_through_aborts,
)
from plait_proxy.chat import (
    ChatRequest,
    Choice,
    Completion,
    FinishReason,
    RequestError,
    ToolCallGrammarRenderer,
)
from plait_proxy.store import ProxySession, RecordedCall


@attrs.frozen
class Limits:
    max_tokens: int = 1024
    """Completion tokens of a request that sets no limit (fewer if the context leaves fewer)."""
    max_context_tokens: int = 32768
    """Prompt plus completion: a request whose prompt leaves no room, or whose own max_tokens
    does not fit beside its prompt, is refused (400)."""


class Proxy:
    """Serves chat requests of many sessions with one engine and the model's renderer."""

    def __init__(
        self,
        engine: InferenceEngine,
        renderer: Renderer,
        model_name: str,
        limits: Limits | None = None,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.model_name = model_name
        self.limits = limits or Limits()

    async def complete(self, session: ProxySession, request: ChatRequest, api: str) -> Completion:
        """Sample `request` and record it in `session`. A cancelled call (the client went away)
        records nothing."""
        tools = request.shown_tools()
        grammar = self._tool_call_grammar(request, tools)
        parent, new_messages = _continuation(session, request.messages, tools)
        prompt, source = self._prompt(session, request.messages, tools, parent, new_messages)
        sampling = self._sampling(session, request, prompt.length)
        if grammar is not None:
            sampling = attrs.evolve(sampling, grammar=grammar)
        session.in_flight += 1
        try:
            sequences = await asyncio.gather(
                *(
                    sample_through_aborts(self.engine, prompt, _nth_seed(sampling, i))
                    for i in range(request.n)
                )
            )
        finally:
            session.in_flight -= 1
        completion_id = uuid.uuid4().hex[:24]
        choices = tuple(
            self._choice(i, seq, request.stop, completion_id) for i, seq in enumerate(sequences)
        )
        session.calls.append(
            RecordedCall(
                index=len(session.calls),
                api=api,
                messages=request.messages,
                tools=tools,
                prompt_ids=tuple(prompt.to_ints()),
                prompt_source=source,
                choices=choices,
                parent=parent,
                response_id=completion_id,
            )
        )
        return Completion(completion_id, request.model, int(time.time()), prompt.to_ints(), choices)

    def _prompt(
        self,
        session: ProxySession,
        messages: Sequence[Message],
        tools: Sequence[object],
        parent: tuple[int, int] | None,
        new_messages: Sequence[Message],
    ) -> tuple[ModelInput, PromptSource]:
        if parent is not None and new_messages:
            call = session.calls[parent[0]]
            bridged = self.renderer.bridge_to_next_turn(
                call.prompt_ids, call.choices[parent[1]].sequence.tokens, new_messages
            )
            if bridged is not None:
                return ModelInput.from_ints(bridged), "bridge"
        try:
            if tools:
                return self.renderer.build_generation_prompt(messages, tools=tools), "render"  # type: ignore[arg-type]
            return self.renderer.build_generation_prompt(messages), "render"
        except (
            ValueError,
            TypeError,
            KeyError,
        ) as exc:  # the renderer's word on a conversation it cannot show
            raise RequestError(
                f"the conversation cannot be rendered for this model: {exc}", param="messages"
            ) from None

    def _tool_call_grammar(self, request: ChatRequest, tools: Sequence[ToolSpec]) -> str | None:
        """Under tool_choice "required" or a named tool, the grammar decoding must follow: calls
        to the shown tools (the named one alone), as the renderer writes them."""
        if request.tool_choice in ("auto", "none"):
            return None
        name = type(self.renderer).__name__
        if not isinstance(self.renderer, ToolCallGrammarRenderer):
            raise RequestError(
                f"tool_choice {request.tool_choice!r} needs decoding constrained to tool calls, "
                f"and the renderer {name} has no tool-call grammar (tool_call_grammar); send "
                'tool_choice "auto", or serve a renderer that has one (plait-qwen\'s, '
                "chat_template)",
                param="tool_choice",
            )
        try:
            return self.renderer.tool_call_grammar(tools, parallel=request.parallel_tool_calls)
        except ValueError as exc:
            raise RequestError(
                f"tool_choice {request.tool_choice!r}: the renderer {name} cannot constrain "
                f"decoding to these tools: {exc}",
                param="tool_choice",
            ) from None

    def _sampling(
        self, session: ProxySession, request: ChatRequest, prompt_tokens: int
    ) -> SamplingParams:
        policy = session.policy
        if policy is None:
            return SamplingParams(
                max_tokens=self._completion_budget(prompt_tokens, request.max_tokens, exact=True),
                seed=request.seed,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
            )
        if len(session.calls) >= policy.max_calls:
            session.policy_exhausted = True
            raise RequestError(
                f"this episode's budget of {policy.max_calls} model calls is spent",
                status=429,
                kind="rate_limit_error",
            )
        run = policy.sampling
        requested = min(filter(None, (request.max_tokens, run.max_tokens)), default=None)
        seed = None if run.seed is None else run.seed + 7919 * len(session.calls)
        return attrs.evolve(
            run,
            max_tokens=self._completion_budget(prompt_tokens, requested, exact=False),
            seed=seed,
        )

    def _completion_budget(self, prompt_tokens: int, requested: int | None, *, exact: bool) -> int:
        """`requested` completion tokens (`Limits.max_tokens` if None) within the room the
        prompt leaves in the context. A client's own limit (`exact`) that does not fit is
        refused, not cut: OpenAI, vLLM and Anthropic (since Claude 3.7) all answer 400 when the
        prompt plus max_tokens exceeds the context window. A run's limit (a session's policy) is
        cut to the room, as the episode's prompt grows."""
        context = self.limits.max_context_tokens
        room = context - prompt_tokens
        # litellm (and so mini-swe-agent) recognises this wording and stops instead of retrying
        if room < 1:
            raise RequestError(
                f"This model's maximum context length is {context} tokens; the prompt is "
                f"{prompt_tokens}: shorten the conversation",
                param="messages",
                kind="context_length_exceeded",
            )
        if exact and requested is not None and requested > room:
            raise RequestError(
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the messages, "
                f"{requested} in the completion). Please reduce the length of the messages or "
                "completion.",
                param="messages",
                kind="context_length_exceeded",
            )
        return min(room, requested or self.limits.max_tokens)

    def _choice(
        self, index: int, sequence: SampledSequence, stops: Sequence[str], completion_id: str
    ) -> Choice:
        tokenizer = self.renderer.tokenizer
        stop_string = None
        if stops:
            sequence, stop_string = _cut_at_stop_string(sequence, stops, tokenizer.decode)
        message, termination = self.renderer.parse_response(sequence.tokens)
        if stop_string is not None:
            message = attrs.evolve(message, content=message.content.split(stop_string, 1)[0])
        message = attrs.evolve(
            message,
            tool_calls=[
                call
                if call.id
                else ToolCall(call.name, call.arguments, f"call_{completion_id[:12]}_{index}_{k}")
                for k, call in enumerate(message.tool_calls)
            ],
        )
        finish: FinishReason = (
            "length" if sequence.stop_reason == "length" and stop_string is None else "stop"
        )
        if message.tool_calls and finish == "stop":
            finish = "tool_calls"
        return Choice(
            index,
            sequence,
            message,
            termination,
            finish,
            stop_string,
            tuple(tokenizer.decode([t]) for t in sequence.tokens),
        )


def _nth_seed(sampling: SamplingParams, i: int) -> SamplingParams:
    return (
        sampling
        if sampling.seed is None or i == 0
        else attrs.evolve(sampling, seed=sampling.seed + i)
    )


def _continuation(
    session: ProxySession, messages: Sequence[Message], tools: Sequence[object]
) -> tuple[tuple[int, int] | None, list[Message]]:
    """The (call, choice) whose conversation and answer `messages` start with, latest first, and
    the messages that follow it."""
    for call in reversed(session.calls):
        size = len(call.messages)
        if len(messages) <= size or tuple(call.tools) != tuple(tools):
            continue
        if not all(_same(a, b) for a, b in zip(messages[:size], call.messages, strict=True)):
            continue
        for choice in call.choices:
            if _same(messages[size], choice.message):
                return (call.index, choice.index), list(messages[size + 1 :])
    return None, list(messages)


def _same(a: Message, b: Message) -> bool:
    """The same message as far as a client can be expected to echo it: reasoning and tool-call
    ids may be dropped or rewritten, whitespace at the ends trimmed."""
    return (
        a.role == b.role
        and a.content.strip() == b.content.strip()
        and [(c.name, c.arguments) for c in a.tool_calls]
        == [(c.name, c.arguments) for c in b.tool_calls]
    )


def _cut_at_stop_string(
    sequence: SampledSequence, stops: Sequence[str], decode: Callable[[list[int]], str]
) -> tuple[SampledSequence, str | None]:
    """`sequence` up to the token that completes the first client stop string in its text, as an
    engine stopping on strings would have returned it (the later tokens were sampled after it and
    change nothing before it). Its routed experts lose the rows of the dropped tokens, keeping
    the convention of one row per token the engine ran but the last: prompt + kept tokens - 1."""
    text = decode(list(sequence.tokens))
    found = [(text.find(s), s) for s in stops if s and s in text]
    if not found:
        return sequence, None
    position, stop = min(found)
    end = position + len(stop)
    low, high = 1, len(sequence.tokens)
    while low < high:  # the shortest prefix whose text reaches the end of the stop string
        mid = (low + high) // 2
        if len(decode(list(sequence.tokens[:mid]))) >= end:
            high = mid
        else:
            low = mid + 1
    versions = sequence.versions()[:low]
    routing = sequence.routed_experts
    if routing is not None:
        routing = _first_rows(routing, max(len(routing) - (len(sequence.tokens) - low), 0))
    return SampledSequence(
        sequence.tokens[:low],
        sequence.logprobs[:low],
        "stop",
        weight_version=versions[-1],
        token_versions=versions,
        routed_experts=routing,
    ), stop


def _first_rows(tensor: TensorData, rows: int) -> TensorData:
    """The first `rows` rows of `tensor`, in its dtype."""
    head = tensor.to_numpy()[:rows]
    return TensorData(head.reshape(-1), tensor.dtype, tuple(head.shape))


def build_proxy(config: RunConfig, limits: Limits | None = None) -> Proxy:
    """The proxy for a run config's model, inference engine and renderer."""
    from plait.api import build, resolve_model

    model = resolve_model(
        config.model.name, tokenizer=config.model.tokenizer, dtype=config.model.dtype
    )
    engine = build(
        "inference_engine",
        config.inference.engine,
        model,
        options=config.inference.options,
        options_path="inference.options",
        seed=config.run.seed,
    )
    renderer = build(
        "renderer",
        config.renderer.name,
        model,
        options=config.renderer.options,
        options_path="renderer.options",
    )
    return Proxy(engine, renderer, config.model.name, limits)
