"""Run an SDK environment in-process, behind the core `Environment` protocol (no HTTP).

`LocalSession` carries the ORS session semantics that the server relies on: calls of one tool run
one at a time unless the tool is `concurrent`, an `exclusive` (or terminal) tool waits for every
in-flight call and holds new ones, and the first result with `finished=True` latches the episode
(later calls, and calls that were queued behind it, are refused without running).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pydantic
import structlog

from plait.api import Block, EnvironmentError_, Message, Split, ToolError, ToolOutput, ToolSpec
from plait_sdk.environment import (
    Environment,
    ToolInfo,
    as_tool_output,
    construct_env,
    input_model,
    run_env_method,
    run_user_callable,
    takes_keywords,
)
from plait_sdk.types import ListToolsOutput, as_block

log = structlog.get_logger("plait_sdk.local")


class LocalEnvironment:
    """Adapts an `Environment` subclass to plait's environment protocol."""

    def __init__(self, env_cls: type[Environment], name: str | None = None) -> None:
        env_cls.check_definition()
        self.env_cls = env_cls
        self.name = name or env_cls.name().lower()
        self.reward_range = env_cls.reward_range

    async def splits(self) -> list[Split]:
        return self.env_cls.splits()

    async def num_tasks(self, split: str) -> int:
        self._check_split(split)
        return await self.env_cls.num_tasks(split)

    async def get_task(self, split: str, index: int) -> dict[str, Any]:
        self._check_split(split)
        total = await self.env_cls.num_tasks(split)
        if not 0 <= index < total:
            raise IndexError(
                f"task index {index} is out of range for split {split!r} ({total} tasks)"
            )
        return dict(await self.env_cls.get_task(split, index))

    async def shared_tools(self) -> tuple[list[ToolSpec], ToolSpec | None]:
        """The tools every session has, and the terminal tool, without opening a session."""
        return list(self.env_cls.list_tools().tools), self.env_cls.terminal_tool_spec()

    def supports_score_group(self) -> bool:
        return self.env_cls.supports_score_group()

    def _check_split(self, split: str) -> None:
        names = [s.name for s in self.env_cls.splits()]
        if split not in names:
            raise KeyError(f"environment {self.name!r} has no split {split!r}; it has {names}")

    async def open(
        self, task: Mapping[str, Any], secrets: Mapping[str, str] | None = None
    ) -> LocalSession:
        try:
            env = await construct_env(
                self.env_cls, task_spec=dict(task), secrets=dict(secrets or {})
            )
        except Exception as exc:
            raise EnvironmentError_(
                f"environment {self.name!r} could not be built for task {dict(task)!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        session = LocalSession(env)
        try:
            await run_env_method(env, "setup")
        except Exception as exc:
            await session.close()
            raise EnvironmentError_(
                f"environment {self.name!r} setup failed: {type(exc).__name__}: {exc}"
            ) from exc
        return session

    async def close(self) -> None:
        pass


class _ExclusiveGate:
    """A writer-preferring readers-writer gate: calls share it, exclusive calls own it."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._active = 0
        self._writing = False
        self._writers_waiting = 0

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing and not self._writers_waiting)
            self._active += 1
        try:
            yield
        finally:
            async with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writing and self._active == 0)
            finally:
                self._writers_waiting -= 1
                self._cond.notify_all()  # a cancelled writer may have held readers back
            self._writing = True
        try:
            yield
        finally:
            async with self._cond:
                self._writing = False
                self._cond.notify_all()


def _finished_error(name: str) -> ToolError:
    return ToolError(
        f"{name!r} was not run: the episode has finished (a tool returned finished=True), "
        "so no further tool calls are accepted",
        "episode_finished",
    )


class LocalSession:
    """One episode of an SDK environment."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.finished = False
        self.closed = False
        self._tool_locks: dict[str, asyncio.Lock] = {}
        self._gate = _ExclusiveGate()

    async def prompt(self) -> list[Block]:
        return [as_block(b) for b in await run_env_method(self.env, "get_prompt")]

    async def messages(self) -> list[Message]:
        return list(await run_env_method(self.env, "get_messages"))

    async def tools(self) -> list[ToolSpec]:
        task_tools = await run_env_method(self.env, "list_task_tools")
        if isinstance(task_tools, ListToolsOutput) or hasattr(task_tools, "tools"):
            task_tools = task_tools.tools
        terminal = self.env.terminal_tool_spec()
        specs = [*self.env.list_tools().tools, *task_tools]
        seen: set[str] = set()
        unique = []
        for spec in specs:
            if spec.name not in seen and (terminal is None or spec.name != terminal.name):
                seen.add(spec.name)
                unique.append(ToolSpec(spec.name, spec.description, spec.input_schema))
        return unique

    async def terminal_tool(self) -> ToolSpec | None:
        return self.env.terminal_tool_spec()

    def supports_score_group(self) -> bool:
        return self.env.supports_score_group()

    async def score_group(self, candidates: Sequence[Mapping[str, Any]]) -> list[float]:
        scores = await run_user_callable(self.env.score_group, list(candidates))
        return [
            float(
                s
                if isinstance(s, int | float)
                else s["reward"]
                if isinstance(s, Mapping)
                else s.reward
            )
            for s in scores
        ]

    async def call(self, name: str, input: Mapping[str, Any]) -> ToolOutput | ToolError:
        if self.closed:
            return ToolError(f"{name!r} was not run: the session is closed", "episode_finished")
        if self.finished:
            return _finished_error(name)
        try:
            bound = self.env.bound_tool(name)
        except ValueError as exc:
            return ToolError(str(exc), "name_collision")
        if bound is None:
            return ToolError(f"{name!r} is not a valid tool of this environment", "not_found")
        fn, info = bound
        if not isinstance(input, Mapping):
            return ToolError(
                f"tool input must be a JSON object, got {type(input).__name__}", "input_validation"
            )
        model = input_model(fn)
        if model is None and input:
            return ToolError(
                f"tool {name!r} takes no input, got keys {sorted(input)}", "input_validation"
            )
        try:
            parsed = model.model_validate(dict(input)) if model is not None else None
        except pydantic.ValidationError as exc:
            return ToolError(
                f"Tool input validation error for {name!r}: {_validation_summary(exc)}",
                "input_validation",
            )
        try:
            return await self._run(name, fn, info, parsed)
        except Exception as exc:  # a tool bug costs this call, never the caller
            log.warning("tool raised", tool=name, error=f"{type(exc).__name__}: {exc}")
            return ToolError(f"tool {name!r} raised {type(exc).__name__}: {exc}", "exception")

    async def _run(self, name: str, fn: Any, info: ToolInfo, parsed: Any) -> ToolOutput | ToolError:
        if info.gates_all:
            async with self._gate.exclusive():
                return await self._invoke_unless_finished(name, fn, parsed)
        if info.concurrent:
            async with self._gate.shared():
                return await self._invoke_unless_finished(name, fn, parsed)
        # The tool lock is taken outside the gate so that calls queued on one tool never hold
        # off an exclusive call.
        async with self._tool_locks.setdefault(name, asyncio.Lock()), self._gate.shared():
            return await self._invoke_unless_finished(name, fn, parsed)

    async def _invoke_unless_finished(
        self, name: str, fn: Any, parsed: Any
    ) -> ToolOutput | ToolError:
        if self.finished or self.closed:  # the call we queued behind ended the episode
            return _finished_error(name)
        if parsed is None:
            result = await run_user_callable(fn)
        elif takes_keywords(type(parsed)):
            result = await run_user_callable(
                fn, **{k: getattr(parsed, k) for k in type(parsed).model_fields}
            )
        else:
            result = await run_user_callable(fn, parsed)
        output = as_tool_output(name, result)
        if self.finished:  # a concurrent call finished the episode first: its grade stands
            return _finished_error(name)
        if output.finished:
            self.finished = True
        return output

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            await run_env_method(self.env, "teardown")
        except Exception as exc:  # closing must always be safe; the failure is logged, not raised
            log.warning(
                "environment teardown failed",
                env=type(self.env).__name__,
                error=f"{type(exc).__name__}: {exc}",
            )


def _validation_summary(exc: pydantic.ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '(input)'}: {err['msg']}" for err in exc.errors()
    )
