"""The rollout store: every call the proxy served, grouped into sessions, as training data.

A session is what one agent episode sent: its calls in order, each with the prompt ids the
engine was given and every choice exactly as sampled. A call whose conversation continues an
earlier call's answer (the client sent that answer back, followed by tool results or a new user
message) names it as its `parent`; the choices that a later call continued are the ones the
episode took. `ProxySession.turns` gives those as `plait.trajectory.Turn`s, which
`plait_algorithms.datums.merge_turns` joins into one training sequence wherever a prompt extends the
previous prompt and completion token for token, and splits where it does not.

A choice's `routed_experts` (mixture-of-experts engines asked for them) is recorded as
`plait.serde.to_json` writes compact ids: {"dtype", "shape", "base64"} of its raw little-endian
bytes (`from_json(TensorData, ...)` reads it back), or null.

Finished sessions leave the store (and, with a directory, are appended to `sessions.jsonl`
there), so a long-running proxy holds only what is in flight. Sessions nobody finishes expire
after `idle_timeout_s`; one that requests opened and left with nothing recorded (refused,
cancelled) leaves at once.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from plait.api import (
    Message,
    ParseTermination,
    PromptSource,
    SamplingParams,
    ToolSpec,
    Turn,
    to_json,
)
from plait_proxy.chat import Choice, RequestError


@attrs.frozen
class RecordedCall:
    """One request the proxy answered."""

    index: int
    api: str
    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...]
    """The tools shown to the model (after `tool_choice`)."""
    prompt_ids: tuple[int, ...]
    prompt_source: PromptSource
    choices: tuple[Choice, ...]
    parent: tuple[int, int] | None
    """(call index, choice index) of the answer this call's conversation continues."""
    response_id: str = ""
    """The id its client got (`Completion.id`)."""


@attrs.frozen
class SessionPolicy:
    """What a controller imposes on an episode's calls: its sampling settings (the client's are
    ignored; each call gets its own seed) and a budget of calls."""

    sampling: SamplingParams
    max_calls: int


@attrs.define
class ProxySession:
    id: str
    policy: SessionPolicy | None = None
    policy_exhausted: bool = False
    """A call was refused because the policy's budget was spent."""
    created: float = attrs.field(factory=time.time)
    last_active: float = attrs.field(factory=time.monotonic)
    calls: list[RecordedCall] = attrs.field(factory=list)
    in_flight: int = 0
    opened_by_request: bool = False
    """Opened because a request named it (not by `open`): it leaves the store again if its
    requests record nothing."""
    requests: int = 0
    """Requests being answered in it (from before they sample until they are answered)."""

    def taken_choices(self) -> list[Choice]:
        """The choice of every call the episode went on with: the one a later call continued,
        else the first."""
        taken = {call.index: 0 for call in self.calls}
        for call in self.calls:
            if call.parent is not None:
                taken[call.parent[0]] = call.parent[1]
        return [call.choices[taken[call.index]] for call in self.calls]

    def turns(self) -> list[Turn]:
        return [
            _turn(call, choice)
            for call, choice in zip(self.calls, self.taken_choices(), strict=True)
        ]

    def conversation(self, response_id: str) -> list[Turn]:
        """The turns that led to the answer `response_id` (its first choice): its call, and each
        earlier call whose answer the next one continued; not the session's other branches."""
        call = next(c for c in reversed(self.calls) if c.response_id == response_id)
        chain = [(call, 0)]
        while call.parent is not None:
            index, choice = call.parent
            call = self.calls[index]
            chain.append((call, choice))
        return [_turn(call, call.choices[choice]) for call, choice in reversed(chain)]

    def to_json(self) -> dict[str, Any]:
        return {
            "session": self.id,
            "created": self.created,
            "calls": [_call_json(c) for c in self.calls],
        }


def _turn(call: RecordedCall, choice: Choice) -> Turn:
    return Turn(
        call.prompt_ids,
        choice.sequence,
        choice.termination is not ParseTermination.MALFORMED,
        call.prompt_source,
    )


def _call_json(call: RecordedCall) -> dict[str, Any]:
    return {
        "index": call.index,
        "api": call.api,
        "prompt_ids": list(call.prompt_ids),
        "prompt_source": call.prompt_source,
        "parent": list(call.parent) if call.parent else None,
        "choices": [
            {
                "index": c.index,
                "token_ids": list(c.sequence.tokens),
                "logprobs": list(c.sequence.logprobs),
                "weight_versions": list(c.sequence.versions()),
                "stop_reason": c.sequence.stop_reason,
                "finish_reason": c.finish_reason,
                "content": c.message.content,
                "reasoning_content": c.message.reasoning_content,
                "tool_calls": [
                    {"id": t.id, "name": t.name, "arguments": t.arguments}
                    for t in c.message.tool_calls
                ],
                "routed_experts": to_json(c.sequence.routed_experts),
            }
            for c in call.choices
        ],
    }


@attrs.define
class RolloutStore:
    """Live sessions by id. `auto_create` lets a request name a session that was never opened
    (a standalone proxy, sessions chosen by the client); otherwise an unknown id is a 404."""

    auto_create: bool = True
    max_sessions: int = 10_000
    idle_timeout_s: float = 3600.0
    directory: Path | None = None
    sessions: dict[str, ProxySession] = attrs.field(factory=dict)

    def open(self, session_id: str | None = None) -> ProxySession:
        session_id = session_id or secrets.token_urlsafe(16)
        if session_id in self.sessions:
            raise RequestError(
                f"session {session_id!r} is already open", status=409, param="session"
            )
        self._make_room()
        session = self.sessions[session_id] = ProxySession(session_id)
        return session

    def get(self, session_id: str) -> ProxySession:
        session = self.sessions.get(session_id)
        if session is None:
            if not self.auto_create:
                raise RequestError(
                    f"unknown session {session_id!r}: open it first (POST /sessions)",
                    status=404,
                    param="session",
                    kind="not_found_error",
                )
            session = self.open(session_id)
            session.opened_by_request = True
        session.last_active = time.monotonic()
        return session

    @contextlib.contextmanager
    def answering(self, session_id: str | None) -> Iterator[ProxySession]:
        """The session a request is answered in: the one it names (see `get`), or one of its own
        for None, gone once it is answered. A session that requests opened and that they leave
        without a recorded call (refused, cancelled) goes too, with the last of them, instead of
        holding a place until the idle timeout."""
        session = self.open() if session_id is None else self.get(session_id)
        session.requests += 1
        try:
            yield session
        finally:
            session.requests -= 1
            unused = session.opened_by_request and not session.requests and not session.calls
            if (session_id is None or unused) and self.sessions.get(session.id) is session:
                del self.sessions[session.id]

    def finish(self, session_id: str) -> ProxySession:
        """Take the session out of the store: its calls are final (requests still in flight are
        not recorded)."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise RequestError(
                f"unknown session {session_id!r}",
                status=404,
                param="session",
                kind="not_found_error",
            )
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            with (self.directory / "sessions.jsonl").open("a") as f:
                f.write(json.dumps(session.to_json()) + "\n")
        return session

    def discard(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def __len__(self) -> int:
        return len(self.sessions)

    def __iter__(self) -> Iterator[ProxySession]:
        return iter(list(self.sessions.values()))

    def _make_room(self) -> None:
        now = time.monotonic()
        for session in list(self.sessions.values()):
            idle = session.in_flight == 0 and not session.requests
            if idle and now - session.last_active > self.idle_timeout_s:
                self.finish(session.id)
        if len(self.sessions) >= self.max_sessions:
            raise RequestError(
                f"the proxy holds {self.max_sessions} open sessions; finish some "
                "(POST /sessions/<id>/finish) or raise max_sessions",
                status=429,
                kind="rate_limit_error",
            )
