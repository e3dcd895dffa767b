"""Episodes: a model talking to an environment, token-in-token-out.

One episode opens a session on a task, renders the opening messages, samples, parses the response,
and then either calls the tools the model asked for (feeding their results back for another turn)
or hands the plain answer to the environment's terminal tool. The environment's tools are shown to
the model through the renderer. A response whose tool call cannot be parsed is answered with an
error message (and counted); the episode goes on.

Token-in-token-out: every prompt and completion is kept as token ids (see `plait.trajectory`).
The next prompt extends the previous prompt and the sampled ids verbatim through the renderer's
`bridge_to_next_turn`; only where the renderer declines is the conversation re-rendered, and the
training data then starts a new datum. Limits: `max_turns` model calls, `sampling.max_tokens` per
response and `max_episode_tokens` of context; hitting one sets the trajectory's truncated flag.

Failures are sorted by whose they are (DESIGN.md §9). The environment's (a call raises or times
out, grading fails) cost this one episode: the trajectory comes back with `error` set. The engine's
are retried once on the same request, then raise `EngineError` naming it; the renderer's raise
`RendererError` naming it; plait's own errors (`PlaitError`: data, config) pass through. The
session is always closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

import attrs
import structlog

from plait.errors import EngineError, EnvironmentError_, PlaitError, RendererError
from plait.protocols import Environment, EnvSession, InferenceEngine, Renderer
from plait.trajectory import PromptSource, Trajectory, Turn
from plait.types import (
    Message,
    ModelInput,
    ParseTermination,
    SampledSequence,
    SamplingParams,
    ToolError,
    ToolOutput,
    ToolSpec,
)

log = structlog.get_logger("plait.rollout")

T = TypeVar("T")
RewardReduce = Literal["sum", "last", "max", "mean"]

ROLE_KEY = "plait.role"
"""Roles, an ORS extension: in a task, the role that acts first; in a tool output's metadata, the
role that acts next, told the output's blocks as a user message. A client that knows no roles
plays every role with one model (the hand-over reaches it as the tool's result)."""
REWARDS_KEY = "plait.rewards"
"""In a tool output's metadata: {role: reward} of this call. The output's own `reward` (what a
plain ORS client sees) is the episode's; without this key it is also the calling role's."""

MALFORMED_FEEDBACK = (
    "Error: your last message could not be parsed (malformed tool call). "
    "Write each tool call in the format the system prompt describes, and try again."
)


@attrs.frozen
class EpisodeConfig:
    sampling: SamplingParams
    """Per model call; `sampling.max_tokens` caps each response."""
    max_turns: int = 1
    """Model calls per episode; an episode that wants more is marked truncated."""
    reward_reduce: RewardReduce = "sum"
    """How the rewards of an episode's tool calls become its reward."""
    env_timeout_s: float = 300.0
    max_episode_tokens: int | None = None
    """Cap on the context: prompt plus every response and observation. Each response may use at
    most what is left; an episode that reaches it is marked truncated."""


_REDUCERS: dict[str, Callable[[Sequence[float]], float]] = {
    "sum": sum,
    "last": lambda r: r[-1],
    "max": max,
    "mean": lambda r: sum(r) / len(r),
}


def reduce_rewards(rewards: Sequence[float], rule: RewardReduce) -> float:
    return float(_REDUCERS[rule](rewards)) if rewards else 0.0


def is_correct(output: ToolOutput) -> bool:
    """An environment marks success with metadata "correct" (or "passed"); else reward >= 1."""
    metadata = output.metadata or {}
    key = next((k for k in ("correct", "passed") if k in metadata), None)
    return bool(metadata[key]) if key else output.reward is not None and output.reward >= 1.0


def terminal_argument(spec: ToolSpec) -> str:
    properties = (spec.input_schema or {}).get("properties") or {}
    return next(iter(properties), "answer")


def _tool_result_message(call_id: str | None, name: str, result: ToolOutput | ToolError) -> Message:
    text = (
        result.text
        if isinstance(result, ToolOutput)
        else f"Error ({result.reason}): {result.error}"
    )
    return Message("tool", text, tool_call_id=call_id, name=name)


@runtime_checkable
class DrivesEpisodes(Protocol):
    """Optional environment capability: it runs whole episodes itself (e.g. an agent via
    plait-proxy)."""

    async def run_episode(
        self,
        task: Mapping[str, Any],
        engine: InferenceEngine,
        renderer: Renderer,
        config: EpisodeConfig,
    ) -> Trajectory: ...


Actor = tuple[InferenceEngine, Renderer]
"""Who plays a role: the engine that samples its turns and the renderer of its conversation."""


@contextlib.contextmanager
def _renderer_blamed(renderer: Renderer) -> Iterator[None]:
    """A renderer that raises is a bug of plait's own parts: it stops the run, named."""
    try:
        yield
    except PlaitError:
        raise
    except Exception as exc:
        raise RendererError(
            f"renderer {type(renderer).__name__} failed: {type(exc).__name__}: {exc}",
            fix="fix the renderer (or pick another: renderer.name); `plait run` then resumes "
            "from the last checkpoint",
        ) from exc


@attrs.define
class _Conversation:
    """One role's side of an episode: what it was told, and its last prompt and completion."""

    actor: Actor
    messages: list[Message] = attrs.field(factory=list)
    pending: list[Message] = attrs.field(factory=list)
    """Messages for this role that arrived while another role was acting."""
    prompt: ModelInput | None = None
    prompt_source: PromptSource = "render"
    completion: Sequence[int] = ()

    def advance(self, new_messages: Sequence[Message], tools: Sequence[ToolSpec]) -> ModelInput:
        """The role's next prompt: its conversation so far plus `new_messages` (and the pending
        ones)."""
        new_messages = [*self.pending, *new_messages]
        self.pending = []
        self.messages.extend(new_messages)
        renderer = self.actor[1]
        with _renderer_blamed(renderer):
            if self.prompt is None:
                self.prompt = _render_prompt(renderer, self.messages, tools)
                self.prompt_source = "render"
            else:
                self.prompt, self.prompt_source = _next_prompt(
                    renderer, self.prompt, self.completion, self.messages, new_messages, tools
                )
        return self.prompt


@attrs.define
class Episode:
    """An episode as it runs: its turns so far, and what the environment said of them."""

    task: Mapping[str, Any]
    config: EpisodeConfig
    turns: list[Turn] = attrs.field(factory=list)
    rewards: list[float] = attrs.field(factory=list)
    role_rewards: dict[str, list[float]] = attrs.field(factory=dict)
    correct: bool = False
    finished: bool = False
    truncated: bool = False
    tool_errors: int = 0
    engine_retries: int = 0
    env_seconds: list[tuple[float, float]] = attrs.field(factory=list)
    """(start, end) of every environment call, for the verify timing."""

    async def env(self, call: Awaitable[T]) -> T:
        """An environment call within `env_timeout_s`; whatever goes wrong in it is the
        environment's (`EnvironmentError_`)."""
        start = time.perf_counter()
        try:
            return await asyncio.wait_for(call, self.config.env_timeout_s)
        except Exception as exc:
            raise EnvironmentError_(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self.env_seconds.append((start, time.perf_counter()))

    async def sample(self, engine: InferenceEngine, prompt: ModelInput) -> SampledSequence | None:
        """One completion within the context budget (None when it is spent). An engine that
        fails is sent the same request once more; a second failure is the step's."""
        sampling = sampling_within_budget(self.config, prompt.length)
        if sampling is None:
            return None
        retried = False
        while True:
            try:
                return await sample_through_aborts(engine, prompt, sampling)
            except Exception as exc:
                if isinstance(exc, PlaitError) and not isinstance(exc, EngineError):
                    raise  # bad data or config: no retry helps
                failure = f"{type(exc).__name__}: {exc}"
                if retried:
                    raise EngineError(
                        f"inference engine {type(engine).__name__} failed twice on the same "
                        f"request: {failure}",
                        fix="see the engine's log; `plait run` resumes from the last checkpoint",
                    ) from exc
                log.warning(
                    "inference engine failed; sending the request once more",
                    engine=type(engine).__name__,
                    error=failure,
                )
                self.engine_retries += 1
                retried = True

    def record(self, output: ToolOutput | ToolError, caller: str) -> None:
        """The episode's reward is the outputs' own; a role's is REWARDS_KEY's, else the
        caller's output's."""
        if isinstance(output, ToolError):
            self.tool_errors += 1
            return
        if output.reward is not None:
            self.rewards.append(float(output.reward))
        by_role = (output.metadata or {}).get(REWARDS_KEY)
        if not isinstance(by_role, Mapping):
            by_role = {} if output.reward is None else {caller: output.reward}
        for role, reward in by_role.items():
            self.role_rewards.setdefault(str(role), []).append(float(reward))
        self.correct = self.correct or is_correct(output)
        self.finished = self.finished or output.finished

    def trajectory(self, error: str | None = None) -> Trajectory:
        named = {turn.role for turn in self.turns} | set(self.role_rewards)
        reduce = self.config.reward_reduce
        return Trajectory(
            task=dict(self.task),
            turns=self.turns,
            rewards=self.rewards,
            reward=reduce_rewards(self.rewards, reduce),
            correct=self.correct,
            finished=self.finished,
            truncated=self.truncated,
            error=error,
            tool_errors=self.tool_errors,
            env_seconds=self.env_seconds,
            role_rewards={}
            if named <= {""}
            else {r: reduce_rewards(self.role_rewards.get(r, ()), reduce) for r in sorted(named)},
            engine_retries=self.engine_retries,
        )


Handover = tuple[str, Message]
"""The role an environment hands the turn to, and what it tells it."""


async def run_episode(
    env: Environment,
    task: Mapping[str, Any],
    engine: InferenceEngine,
    renderer: Renderer,
    config: EpisodeConfig,
    roles: Mapping[str, Actor] | None = None,
) -> Trajectory:
    """One episode of `task`. `engine` and `renderer` play every role `roles` does not name."""
    if isinstance(env, DrivesEpisodes):
        return await env.run_episode(task, engine, renderer, config)
    episode = Episode(task, config)
    session: EnvSession | None = None
    try:
        session = await episode.env(env.open(task))
        await _play(episode, session, {**(roles or {})}, (engine, renderer))
        return episode.trajectory()
    except EnvironmentError_ as exc:  # the environment's failure costs this episode only
        log.warning("episode failed", error=exc.message, task=_short(task))
        return episode.trajectory(error=exc.message)
    finally:
        if session is not None:
            try:
                await asyncio.wait_for(session.close(), config.env_timeout_s)
            except Exception as exc:
                log.warning("session close failed", error=f"{type(exc).__name__}: {exc}")


async def _play(
    episode: Episode, session: EnvSession, actors: dict[str, Actor], default: Actor
) -> None:
    """Turns until the episode finishes, truncates or the model stops asking for anything."""
    conversations: dict[str, _Conversation] = {}

    def conversation(role: str) -> _Conversation:
        if role not in conversations:
            conversations[role] = _Conversation(actors.get(role, default))
        return conversations[role]

    messages = list(await episode.env(session.messages()))
    terminal = await episode.env(session.terminal_tool())
    tools = list(await episode.env(session.tools()))
    role = str(episode.task.get(ROLE_KEY, ""))
    current = conversation(role)
    prompt = current.advance(messages, tools)
    for turn_index in range(episode.config.max_turns):
        sequence = await episode.sample(current.actor[0], prompt)
        if sequence is None:
            episode.truncated = True  # the context budget is spent
            return
        with _renderer_blamed(current.actor[1]):
            message, termination = current.actor[1].parse_response(sequence.tokens)
        malformed = termination is ParseTermination.MALFORMED
        episode.turns.append(
            Turn(prompt.to_ints(), sequence, not malformed, current.prompt_source, role)
        )
        current.completion = sequence.tokens
        current.messages.append(message)
        episode.truncated = episode.truncated or sequence.stop_reason == "length"
        response = await _respond(episode, session, message, malformed, terminal, role)
        if response is None or episode.finished:
            return
        if turn_index + 1 == episode.config.max_turns:
            episode.truncated = True
            return
        new_messages, handover = response
        if handover is not None:
            current.pending.extend(new_messages)
            role, told = handover
            current, new_messages = conversation(role), [told]
        prompt = current.advance(new_messages, tools)


async def _respond(
    episode: Episode,
    session: EnvSession,
    message: Message,
    malformed: bool,
    terminal: ToolSpec | None,
    role: str,
) -> tuple[list[Message], Handover | None] | None:
    """What the model's role is told next (feedback on a malformed message, the results of its
    tool calls) and the hand-over an output asks for; None when nothing takes the answer."""
    if malformed:
        episode.tool_errors += 1
        return [Message("user", MALFORMED_FEEDBACK)], None
    if message.tool_calls:
        results: list[Message] = []
        handover: Handover | None = None
        for call in message.tool_calls:
            output = await episode.env(session.call(call.name, call.arguments))
            episode.record(output, role)
            results.append(_tool_result_message(call.id, call.name, output))
            handover = handover or _handover(output, role)
            if episode.finished:
                break
        return results, handover
    if terminal is None:
        return None
    output = await episode.env(
        session.call(terminal.name, {terminal_argument(terminal): message.content})
    )
    if isinstance(output, ToolError) and output.reason == "exception":
        # grading itself failed (e.g. its sandbox): no reward to train on, not a 0
        raise EnvironmentError_(f"grading the answer failed: {output.error}")
    episode.record(output, role)
    handover = _handover(output, None)
    # a plain answer ends the episode, unless the environment hands the turn on
    episode.finished = episode.finished or handover is None
    return [], handover


def _handover(output: ToolOutput | ToolError, current: str | None) -> Handover | None:
    """The role `output` hands the turn to and what it tells it; None when it names no role, or
    (after a tool call, whose result the caller already gets) the caller's own."""
    if not isinstance(output, ToolOutput) or ROLE_KEY not in (output.metadata or {}):
        return None
    role = str((output.metadata or {})[ROLE_KEY])
    return None if role == current else (role, Message("user", output.text))


async def sample_through_aborts(
    engine: InferenceEngine, prompt: ModelInput, sampling: SamplingParams
) -> SampledSequence:
    """One completion of `prompt`. A sequence that a pause("abort") ended (an in-flight weight
    update) is continued by a new request from where it stopped, its tokens so far appended to
    the prompt, so a partial rollout is never lost; its tokens keep the versions that made them."""
    sequence = (await engine.sample(prompt, 1, sampling)).sequences[0]
    while sequence.stop_reason == "abort":
        budget = None if sampling.max_tokens is None else sampling.max_tokens - len(sequence.tokens)
        if budget is not None and budget <= 0:
            return attrs.evolve(sequence, stop_reason="length")
        seed = None if sampling.seed is None else sampling.seed + len(sequence.tokens)
        more = (
            await engine.sample(
                prompt.append_ints(sequence.tokens),
                1,
                attrs.evolve(sampling, max_tokens=budget, seed=seed),
            )
        ).sequences[0]
        sequence = SampledSequence(
            sequence.tokens + more.tokens,
            sequence.logprobs + more.logprobs,
            more.stop_reason,
            weight_version=more.weight_version,
            token_versions=sequence.versions() + more.versions(),
            routed_experts=more.routed_experts,
        )  # the continuation's covers the whole sequence
    return sequence


def _render_prompt(
    renderer: Renderer, messages: Sequence[Message], tools: Sequence[ToolSpec]
) -> ModelInput:
    # Renderers written before tools joined the contract take no `tools` argument.
    if tools:
        return renderer.build_generation_prompt(messages, tools=tools)
    return renderer.build_generation_prompt(messages)


def sampling_within_budget(config: EpisodeConfig, context_tokens: int) -> SamplingParams | None:
    """The sampling parameters of the next call, with max_tokens cut to the context budget that
    is left; None when nothing is left."""
    if config.max_episode_tokens is None:
        return config.sampling
    left = config.max_episode_tokens - context_tokens
    if left < 1:
        return None
    if config.sampling.max_tokens is not None and config.sampling.max_tokens <= left:
        return config.sampling
    return attrs.evolve(config.sampling, max_tokens=left)


def _next_prompt(
    renderer: Renderer,
    prompt: ModelInput,
    completion: Sequence[int],
    messages: Sequence[Message],
    new_messages: Sequence[Message],
    tools: Sequence[ToolSpec],
) -> tuple[ModelInput, PromptSource]:
    """Extend the sampled tokens verbatim when the renderer can; otherwise re-render.

    A re-rendered prompt that does not extend the previous prompt + completion token for token
    starts a new datum in `plait_algorithms.datums.merge_turns` (checked there, never assumed here).
    """
    previous = [*prompt.to_ints(), *completion]
    bridged = renderer.bridge_to_next_turn(prompt.to_ints(), list(completion), new_messages)
    if bridged is not None:
        return ModelInput.from_ints(bridged), "bridge"
    rendered = _render_prompt(renderer, messages, tools)
    if rendered.to_ints()[: len(previous)] != previous:
        log.debug(
            "re-rendered prompt does not extend the previous turn; its datum ends here",
            previous_tokens=len(previous),
            prompt_tokens=rendered.length,
        )
    return rendered, "render"


def _short(task: Mapping[str, Any]) -> str:
    text = json.dumps(dict(task), default=str)
    return text if len(text) <= 200 else text[:197] + "..."
