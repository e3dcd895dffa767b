"""Run an SDK environment in-process, behind the core `Environment` protocol (no HTTP)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pydantic

from plait.errors import EnvironmentError_
from plait.types import Block, Message, Split, ToolError, ToolOutput, ToolSpec
from plait_sdk.environment import Environment, as_tool_output, input_model, maybe_await


class LocalEnvironment:
    """Adapts an `Environment` subclass to plait's environment protocol."""

    def __init__(self, env_cls: type[Environment], name: str | None = None) -> None:
        self.env_cls = env_cls
        self.name = name or env_cls.name()

    async def splits(self) -> list[Split]:
        return self.env_cls.splits()

    async def num_tasks(self, split: str) -> int:
        self._check_split(split)
        return await self.env_cls.num_tasks(split)

    async def get_task(self, split: str, index: int) -> dict[str, Any]:
        self._check_split(split)
        total = await self.env_cls.num_tasks(split)
        if not 0 <= index < total:
            raise IndexError(f"task index {index} is out of range for split {split!r} ({total} tasks)")
        return dict(await self.env_cls.get_task(split, index))

    def _check_split(self, split: str) -> None:
        names = [s.name for s in self.env_cls.splits()]
        if split not in names:
            raise KeyError(f"environment {self.name!r} has no split {split!r}; it has {names}")

    async def open(self, task: Mapping[str, Any], secrets: Mapping[str, str] | None = None) -> LocalSession:
        env = self.env_cls(task_spec=dict(task), secrets=dict(secrets or {}))
        session = LocalSession(env)
        try:
            await maybe_await(env.setup())
        except Exception as exc:
            await session.close()
            raise EnvironmentError_(f"environment {self.name!r} setup failed: {type(exc).__name__}: {exc}") from exc
        return session

    async def close(self) -> None:
        pass


class LocalSession:
    """One episode: tool calls with ORS semantics (finished latch, per-tool serialisation)."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.finished = False
        self.closed = False
        self._tool_locks: dict[str, asyncio.Lock] = {}
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._exclusive = asyncio.Lock()

    async def prompt(self) -> list[Block]:
        return list(await maybe_await(self.env.get_prompt()))

    async def messages(self) -> list[Message]:
        return list(await self.env.get_messages())

    async def tools(self) -> list[ToolSpec]:
        return self.env.list_task_tools()

    async def terminal_tool(self) -> ToolSpec | None:
        return self.env.terminal_tool()

    async def call(self, name: str, input: Mapping[str, Any]) -> ToolOutput | ToolError:
        if self.closed:
            return ToolError("the session is closed", "episode_finished")
        if self.finished:
            return ToolError("the episode has finished; no more tool calls are accepted", "episode_finished")
        try:
            bound = self.env.bound_tool(name)
        except ValueError as exc:
            return ToolError(str(exc), "name_collision")
        if bound is None:
            return ToolError(f"{name!r} is not a tool of this environment", "not_found")
        fn, info = bound
        model = input_model(fn)
        if not isinstance(input, Mapping):
            return ToolError(f"tool input must be a JSON object, got {type(input).__name__}", "input_validation")
        try:
            parsed = model.model_validate(dict(input)) if model is not None else None
        except pydantic.ValidationError as exc:
            return ToolError(f"invalid input for tool {name!r}: {_validation_summary(exc)}", "input_validation")
        if model is None and input:
            return ToolError(f"tool {name!r} takes no input, got keys {sorted(input)}", "input_validation")
        try:
            output = await self._run(name, fn, info, model, parsed)
        except Exception as exc:  # a tool bug costs this call, never the caller
            return ToolError(f"tool {name!r} raised {type(exc).__name__}: {exc}", "exception")
        if output.finished:
            self.finished = True
        return output

    async def _run(self, name: str, fn: Any, info: Any, model: Any, parsed: Any) -> ToolOutput:
        if info.exclusive:
            async with self._exclusive:
                await self._idle.wait()
                return await self._invoke(name, fn, model, parsed)
        async with self._exclusive:  # wait for a running exclusive call
            pass
        if info.concurrent:
            return await self._tracked(name, fn, model, parsed)
        lock = self._tool_locks.setdefault(name, asyncio.Lock())
        async with lock:
            return await self._tracked(name, fn, model, parsed)

    async def _tracked(self, name: str, fn: Any, model: Any, parsed: Any) -> ToolOutput:
        self._in_flight += 1
        self._idle.clear()
        try:
            return await self._invoke(name, fn, model, parsed)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    @staticmethod
    async def _invoke(name: str, fn: Any, model: Any, parsed: Any) -> ToolOutput:
        if model is None:
            result = fn()
        elif getattr(model, "__plait_kwargs__", False):
            result = fn(**{k: getattr(parsed, k) for k in type(parsed).model_fields})
        else:
            result = fn(parsed)
        return as_tool_output(name, await maybe_await(result))

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await maybe_await(self.env.teardown())


def _validation_summary(exc: pydantic.ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '(input)'}: {err['msg']}" for err in exc.errors()
    )
