"""Gymnasium adapters, both ways (needs `pip install gymnasium`).

- `PlaitGymEnv(env, split=...)`: any plait environment as a `gymnasium.Env` with text
  observations. `reset()` opens a session on a task (chosen by `options={"index": i}` or by the
  seeded generator) and observes the prompt; `step(action)` makes one tool call, where `action` is
  `{"name": ..., "input": {...}}`, its JSON, or plain text (passed to the terminal tool).
  `terminated` is the environment's `finished`; `truncated` is the step budget running out.
- `GymnasiumEnvironment(make_env, ...)`: a gymnasium environment with text (or text-renderable)
  observations as a plait environment. A task is a seed; the session offers one tool, `act`,
  whose `action` string is parsed into the gym action; `finished` is `terminated or truncated`.

The plait protocol is async and gymnasium is not: `PlaitGymEnv` runs the environment on an event
loop in a private thread, and `GymnasiumEnvironment` runs the gym calls in worker threads.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

from plait.api import Message, Split, TextBlock, ToolError, ToolOutput, ToolSpec, blocks_text
from plait_sdk.types import SPLIT_TYPES

MAX_TEXT = 1 << 20


class _LoopThread:
    """An event loop in a daemon thread, so synchronous code can call async environments."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, daemon=True, name="plait-gym-loop"
        )
        self.thread.start()

    def run(self, coro: Any, timeout: float | None) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def _text_space() -> spaces.Text:
    import string

    charset = string.printable + "".join(chr(c) for c in range(0xA0, 0x3000))
    return spaces.Text(max_length=MAX_TEXT, min_length=0, charset=charset)


class PlaitGymEnv(gymnasium.Env):
    """A plait environment (`plait.protocols.Environment`) as a gymnasium environment."""

    metadata = {"render_modes": ["ansi"]}

    def __init__(
        self,
        env: Any,
        split: str = "train",
        *,
        max_steps: int = 16,
        call_timeout_s: float = 600.0,
        render_mode: str | None = None,
    ) -> None:
        self.env = env
        self.split = split
        self.max_steps = max_steps
        self.call_timeout_s = call_timeout_s
        self.render_mode = render_mode
        self.observation_space = _text_space()
        self.action_space = _text_space()
        self._loop = _LoopThread()
        self._session: Any = None
        self._tools: list[ToolSpec] = []
        self._terminal: ToolSpec | None = None
        self._steps = 0
        self._last_text = ""

    def _run(self, coro: Any) -> Any:
        return self._loop.run(coro, self.call_timeout_s)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self._close_session()
        total = self._run(self.env.num_tasks(self.split))
        if total == 0:
            raise ValueError(f"split {self.split!r} of environment {self.env.name!r} has no tasks")
        index = (
            int(options["index"])
            if options and "index" in options
            else int(self.np_random.integers(total))
        )
        task = self._run(self.env.get_task(self.split, index))
        self._session = self._run(self.env.open(task))
        self._tools = self._run(self._session.tools())
        self._terminal = self._run(self._session.terminal_tool())
        self._steps = 0
        self._last_text = blocks_text(self._run(self._session.prompt()))
        info = {"task": task, "index": index, "tools": self._tools, "terminal_tool": self._terminal}
        return self._last_text, info

    def _parse(self, action: Any) -> tuple[str, Mapping[str, Any]] | ToolError:
        if isinstance(action, Mapping):
            return str(action.get("name", "")), action.get("input") or {}
        text = str(action)
        try:
            call = json.loads(text)
        except ValueError:
            call = None
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            return call["name"], call.get("input") or {}
        if self._terminal is not None:
            fields = list((self._terminal.input_schema or {}).get("properties", {}))
            return self._terminal.name, {fields[0]: text} if fields else {}
        return ToolError(
            'an action must be {"name": tool, "input": {...}} (this environment has no terminal '
            "tool for plain text)",
            "input_validation",
        )

    def step(self, action: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._session is None:
            raise RuntimeError("call reset() before step()")
        parsed = self._parse(action)
        result = parsed if isinstance(parsed, ToolError) else self._run(self._session.call(*parsed))
        self._steps += 1
        if isinstance(result, ToolError):
            observation, reward, terminated = (
                f"error: {result.error}",
                0.0,
                result.reason == "episode_finished",
            )
            info: dict[str, Any] = {"tool_error": result}
        else:
            observation, reward, terminated = (
                result.text,
                float(result.reward or 0.0),
                result.finished,
            )
            info = {"metadata": result.metadata, "reward_given": result.reward is not None}
        truncated = not terminated and self._steps >= self.max_steps
        self._last_text = observation
        if terminated or truncated:
            self._close_session()
        return observation, reward, terminated, truncated, info

    def render(self) -> str | None:
        return self._last_text if self.render_mode == "ansi" else None

    def _close_session(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            self._run(session.close())

    def close(self) -> None:
        self._close_session()
        self._loop.stop()


def parse_action(space: spaces.Space, text: str) -> Any:
    """The gym action a text stands for: an integer for Discrete, JSON for the rest."""
    text = text.strip()
    if isinstance(space, spaces.Discrete):
        value: Any = int(text)
    elif isinstance(space, spaces.Text):
        value = text
    else:
        value = json.loads(text)
        value = (
            np.asarray(value, dtype=space.dtype)
            if isinstance(space, spaces.Box | spaces.MultiDiscrete)
            else value
        )
    if not space.contains(value):
        raise ValueError(f"{text!r} is not in the action space {space}")
    return value


_HIGHLIGHT = re.compile(r"\x1b\[[0-9;]*[1-9][0-9;]*m(.*?)\x1b\[0?m", re.S)
_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def ansi_to_text(rendered: str) -> str:
    """Terminal colours made readable: highlighted text (e.g. the agent's cell) becomes [text]."""
    return _ESCAPE.sub("", _HIGHLIGHT.sub(r"[\1]", rendered))


def observation_text(env: gymnasium.Env, observation: Any) -> str:
    """A text view of a gym observation: the observation if it is text, else the ANSI render,
    else repr."""
    if isinstance(observation, str):
        return observation
    if getattr(env, "render_mode", None) == "ansi":
        rendered = env.render()
        if rendered:
            return ansi_to_text(str(rendered)).strip("\n")
    return (
        json.dumps(observation.tolist())
        if isinstance(observation, np.ndarray)
        else str(observation)
    )


class _GymSession:
    def __init__(
        self, owner: GymnasiumEnvironment, gym_env: gymnasium.Env, observation: str
    ) -> None:
        self.owner = owner
        self.gym_env = gym_env
        self.observation = observation
        self.finished = False
        self.closed = False
        self._lock = asyncio.Lock()

    async def prompt(self) -> list[TextBlock]:
        return [TextBlock(f"{self.owner.instructions}\n\n{self.observation}".strip())]

    async def messages(self) -> list[Message]:
        return [Message("user", (await self.prompt())[0].text)]

    async def tools(self) -> list[ToolSpec]:
        return [self.owner.tool_spec()]

    async def terminal_tool(self) -> ToolSpec | None:
        return None

    async def call(self, name: str, input: Mapping[str, Any]) -> ToolOutput | ToolError:
        if self.closed or self.finished:
            return ToolError(f"{name!r} was not run: the episode has finished", "episode_finished")
        if name != "act":
            return ToolError(f"{name!r} is not a valid tool; the only tool is 'act'", "not_found")
        if (
            not isinstance(input, Mapping)
            or set(input) != {"action"}
            or not isinstance(input["action"], str)
        ):
            return ToolError('act takes exactly {"action": string}', "input_validation")
        try:
            action = parse_action(self.gym_env.action_space, input["action"])
        except (ValueError, TypeError) as exc:
            return ToolError(f"invalid action: {exc}", "input_validation")
        async with self._lock:
            if self.finished:
                return ToolError("'act' was not run: the episode has finished", "episode_finished")
            try:
                obs, reward, terminated, truncated, info = await asyncio.to_thread(
                    self.gym_env.step, action
                )
            except Exception as exc:  # the gym env's bug costs this call, not the caller
                return ToolError(
                    f"the gymnasium environment raised {type(exc).__name__}: {exc}", "exception"
                )
            self.observation = await asyncio.to_thread(observation_text, self.gym_env, obs)
            self.finished = bool(terminated or truncated)
        reward = float(reward)
        return ToolOutput(
            blocks=[TextBlock(self.observation)],
            reward=reward if math.isfinite(reward) else None,
            finished=self.finished,
            metadata={
                "terminated": bool(terminated),
                "truncated": bool(truncated),
                "info": _jsonable(info),
            },
        )

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await asyncio.to_thread(self.gym_env.close)


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


class GymnasiumEnvironment:
    """A gymnasium environment as a plait environment: tasks are seeds, actions are text."""

    def __init__(
        self,
        make_env: Callable[[], gymnasium.Env],
        *,
        name: str,
        splits: Mapping[str, Sequence[int]] | None = None,
        instructions: str = "",
    ) -> None:
        self.make_env = make_env
        self.name = name
        self.seeds = {
            k: list(v)
            for k, v in (splits or {"train": range(100), "test": range(100, 120)}).items()
        }
        self.instructions = instructions
        probe = make_env()
        try:
            self.action_space = probe.action_space
        finally:
            probe.close()

    def tool_spec(self) -> ToolSpec:
        return ToolSpec(
            "act",
            f"Take one action in the environment; the action space is {self.action_space}.",
            {
                "type": "object",
                "properties": {"action": {"type": "string"}},
                "required": ["action"],
                "additionalProperties": False,
            },
        )

    async def splits(self) -> list[Split]:
        return [Split(n, n if n in SPLIT_TYPES else "validation") for n in self.seeds]

    def _seeds(self, split: str) -> list[int]:
        if split not in self.seeds:
            raise KeyError(
                f"environment {self.name!r} has no split {split!r}; it has {sorted(self.seeds)}"
            )
        return self.seeds[split]

    async def num_tasks(self, split: str) -> int:
        return len(self._seeds(split))

    async def get_task(self, split: str, index: int) -> dict[str, Any]:
        seeds = self._seeds(split)
        if not 0 <= index < len(seeds):
            raise IndexError(
                f"task index {index} is out of range for split {split!r} ({len(seeds)} tasks)"
            )
        return {"seed": seeds[index]}

    async def open(
        self, task: Mapping[str, Any], secrets: Mapping[str, str] | None = None
    ) -> _GymSession:
        seed = task.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f'a {self.name} task is {{"seed": int}}, got {dict(task)!r}')
        gym_env = await asyncio.to_thread(self.make_env)
        try:
            observation, _ = await asyncio.to_thread(gym_env.reset, seed=seed)
            text = await asyncio.to_thread(observation_text, gym_env, observation)
        except BaseException:
            await asyncio.to_thread(gym_env.close)
            raise
        return _GymSession(self, gym_env, text)

    async def close(self) -> None:
        pass
