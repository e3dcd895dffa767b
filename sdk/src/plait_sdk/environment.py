"""The environment base class and the `@tool` / `@terminal` decorators.

The surface matches the `ors` package (ors-sdk 0.1.0): subclass `Environment`, implement
`get_prompt`, `list_splits` and `list_tasks`, and mark actions with `@tool`. A tool takes no
argument, one pydantic model (the ORS style), or plain typed keyword arguments (the input schema is
derived from the type hints); it returns a `ToolOutput` (a plain string is wrapped into one). It
may be sync or async; sync code runs in a worker thread so that it never blocks the event loop.

From the `openreward` SDK it adds `@tool(concurrent=..., exclusive=...)`, the `@terminal` tool that
receives a plain-text final answer, `get_messages()`, `score_group()`, and the finished latch
(enforced by the session, see `plait_sdk.local`).

One deliberate difference: `@tool(shared=False)` tools are listed for every session by default
(`list_task_tools`); `ors` lists them only when `list_task_tools` is overridden to name them.
Overriding `list_task_tools` works the same in both.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, get_type_hints

import attrs
import pydantic

from plait.api import Message, Split, TextBlock, ToolOutput, ToolSpec
from plait_sdk.types import (
    SPLIT_TYPES,
    Blocks,
    JSONObject,
    ListToolsOutput,
    TerminalToolSpec,
    prompt_as_messages,
    terminal_tool_from_spec,
)

_TOOL_ATTR = "_plait_tool"
_TOOL_METHODS: weakref.WeakKeyDictionary[
    type, dict[str, tuple[Callable[..., Any], ToolInfo, type | None]]
] = weakref.WeakKeyDictionary()


@attrs.define
class ToolInfo:
    """What `@tool` / `@terminal` record about a method."""

    shared: bool = True
    concurrent: bool = False
    exclusive: bool = False
    terminal: bool = False

    @property
    def serialised(self) -> bool:
        return not self.concurrent

    @property
    def gates_all(self) -> bool:
        """Waits for every in-flight call and holds new ones while it runs."""
        return self.exclusive or self.terminal


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    shared: bool = True,
    concurrent: bool = False,
    exclusive: bool = False,
) -> Any:
    """Mark a method as a tool.

    By default calls of one tool run one at a time per session (different tools overlap), so
    parallel calls cannot race a grader. concurrent=True lets calls of it overlap (for tools that
    never grant reward: shell, reads, search); exclusive=True (for a submit-style tool) waits for
    every in-flight call and holds new ones until it returns. shared=False makes it a per-task tool
    (listed by `list_task_tools`, not by the class-level `list_tools`).
    """
    if concurrent and exclusive:
        raise ValueError("@tool(concurrent=True, exclusive=True) contradicts itself: choose one")

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        info = getattr(f, _TOOL_ATTR, None) or ToolInfo()
        info.shared, info.concurrent, info.exclusive = shared, concurrent, exclusive
        setattr(f, _TOOL_ATTR, info)
        return f

    return mark(fn) if fn is not None else mark


def terminal(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark the tool that receives the model's plain-text final answer.

    It takes no argument or exactly one (a string field, or a pydantic model with one field). It
    is hidden from the tool list and advertised as the terminal tool: a rollout that ends with a
    message and no tool call passes that message's text to it. It always runs exclusively.
    Works with or without `@tool`, in either order.
    """
    info = getattr(fn, _TOOL_ATTR, None) or ToolInfo()
    info.terminal = True
    setattr(fn, _TOOL_ATTR, info)
    return fn


def tool_info(fn: Any) -> ToolInfo | None:
    return getattr(fn, _TOOL_ATTR, None) if callable(fn) else None


def _params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]


@functools.cache
def _input_model(real: Callable[..., Any]) -> type[pydantic.BaseModel] | None:
    params = _params(real)
    if not params:
        return None
    hints = get_type_hints(real, include_extras=True)
    first = hints.get(params[0].name)
    if len(params) == 1 and inspect.isclass(first) and issubclass(first, pydantic.BaseModel):
        return first
    fields: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(
                f"tool {real.__name__!r}: *args/**kwargs cannot be described by a schema"
            )
        fields[p.name] = (hints.get(p.name, Any), ... if p.default is p.empty else p.default)
    model = pydantic.create_model(
        f"{real.__name__}_input", __config__=pydantic.ConfigDict(extra="forbid"), **fields
    )
    model.__plait_kwargs__ = True
    return model


def input_model(fn: Callable[..., Any]) -> type[pydantic.BaseModel] | None:
    """The pydantic model that validates a tool's input (None for a tool without arguments)."""
    return _input_model(inspect.unwrap(getattr(fn, "__func__", fn)))


def takes_keywords(model: type[pydantic.BaseModel]) -> bool:
    """True when the model was built from a tool's typed keyword arguments."""
    return getattr(model, "__plait_kwargs__", False)


def tool_spec(name: str, fn: Callable[..., Any]) -> ToolSpec:
    schema = _input_schema(inspect.unwrap(getattr(fn, "__func__", fn)))
    return ToolSpec(
        name=name,
        description=inspect.cleandoc(fn.__doc__ or ""),
        input_schema=copy.deepcopy(schema),
    )


@functools.cache
def _input_schema(fn: Callable[..., Any]) -> dict[str, Any] | None:
    """A tool's input JSON schema, made once per function: a server lists tools for every
    session, and pydantic builds a schema in about a millisecond (measured: a third of the ORS
    server's time at 128 episodes a step)."""
    model = input_model(fn)
    schema = model.model_json_schema() if model is not None else None
    if schema is not None and takes_keywords(model):  # type: ignore[arg-type]
        schema.pop("title", None)  # a generated name ("submit_input") says nothing to the model
    return schema


async def run_user_callable(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call user code without blocking the event loop: async runs on the loop, sync in a thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.to_thread(fn, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


async def run_env_method(env: Environment, name: str, *args: Any) -> Any:
    """`run_user_callable` on method `name` of `env`. The SDK's own defaults hold no user code and
    return at once: they run inline, sparing every episode a thread hop per default (with many
    episodes at once, those hops spread their first model calls over milliseconds)."""
    method = getattr(env, name)
    if getattr(type(env), name) is not getattr(Environment, name):
        return await run_user_callable(method, *args)
    result = method(*args)
    return await result if inspect.isawaitable(result) else result


async def construct_env(env_cls: type[Environment], **kwargs: Any) -> Environment:
    """`env_cls(**kwargs)`: in a thread when the class has a constructor of its own, else inline."""
    if env_cls.__init__ is Environment.__init__:
        return env_cls(**kwargs)
    return await run_user_callable(env_cls, **kwargs)


def as_tool_output(name: str, result: Any) -> ToolOutput:
    if isinstance(result, ToolOutput):
        return result
    if isinstance(result, str):
        return ToolOutput(blocks=[TextBlock(result)])
    raise TypeError(f"tool {name!r} returned {type(result).__name__}; expected ToolOutput (or str)")


class Toolset(ABC):  # noqa: B024 - a marker base, as in ors
    """A reusable collection of tools; list it in an environment's `toolsets`."""

    def __init__(self, env: Any) -> None:
        self.env = env


class Environment(ABC):
    """An RL environment: tasks in splits, a prompt per task, and tools that act and reward."""

    toolsets: ClassVar[Sequence[type]] = ()
    reward_range: ClassVar[tuple[float, float] | None] = None
    """The (low, high) every reward lies in, when the environment declares one (checked by the
    contract kit)."""

    def __init__(
        self, task_spec: JSONObject | None = None, secrets: Mapping[str, str] | None = None
    ) -> None:
        self.task_spec: JSONObject = dict(task_spec or {})
        self.secrets: Mapping[str, str] = dict(secrets or {})
        self._toolset_instances: dict[type, Any] = {}

    # -- lifecycle -------------------------------------------------------------------------

    def setup(self) -> Any:
        """Prepare the episode (runs once, before the first prompt or call)."""

    def teardown(self) -> Any:
        """Release what setup acquired; always called, also after a failure."""

    # -- tasks -----------------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def list_splits(cls) -> Sequence[Split | str]:
        """The split names (or Split objects)."""

    @classmethod
    @abstractmethod
    def list_tasks(cls, split: str) -> Any:
        """Every task of `split` (a sequence of JSON objects; may be async). Override
        `num_tasks`/`get_task` instead for large or procedural splits."""

    @classmethod
    async def num_tasks(cls, split: str) -> int:
        return len(await run_user_callable(cls.list_tasks, split))

    @classmethod
    async def get_task(cls, split: str, index: int) -> JSONObject:
        tasks = await run_user_callable(cls.list_tasks, split)
        return tasks[index]

    @classmethod
    async def get_task_range(
        cls, split: str, start: int | None = None, stop: int | None = None
    ) -> list[JSONObject]:
        """Tasks `start:stop` with Python slice semantics (negative indices count from the end)."""
        total = await cls.num_tasks(split)
        return [await cls.get_task(split, i) for i in range(*slice(start, stop).indices(total))]

    @classmethod
    def splits(cls) -> list[Split]:
        return [
            s if isinstance(s, Split) else Split(s, s if s in SPLIT_TYPES else "validation")
            for s in cls.list_splits()
        ]

    # -- prompt ----------------------------------------------------------------------------

    @abstractmethod
    def get_prompt(self) -> Blocks | Any:
        """The task's prompt as text/image blocks (may be async)."""

    async def get_messages(self) -> list[Message]:
        """The opening chat messages; by default the prompt as one user message."""
        return prompt_as_messages(await run_user_callable(self.get_prompt))

    # -- group scoring (optional) ------------------------------------------------------------

    async def score_group(self, candidates: Sequence[Mapping[str, Any]]) -> Sequence[float]:
        """Score a group of candidate transcripts of this task, one reward each (override to
        enable `/score_group`). Each candidate is `{"messages": [...], "metadata": {...}}`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement score_group()")

    @classmethod
    def supports_score_group(cls) -> bool:
        return cls.score_group is not Environment.score_group

    # -- tools -----------------------------------------------------------------------------

    @classmethod
    def name(cls) -> str:
        return cls.__name__

    @classmethod
    def _tool_methods(cls) -> dict[str, tuple[Callable[..., Any], ToolInfo, type | None]]:
        """Tool name -> (function, info, owning toolset or None). Raises on name collisions.

        Found once per class and kept (read-only): every tool call looks its tool up here, and
        scanning the class with dir() each time cost more than the rest of the call.
        """
        found = _TOOL_METHODS.get(cls)
        if found is None:
            found = _TOOL_METHODS[cls] = cls._find_tool_methods()
        return found

    @classmethod
    def _find_tool_methods(cls) -> dict[str, tuple[Callable[..., Any], ToolInfo, type | None]]:
        found: dict[str, tuple[Callable[..., Any], ToolInfo, type | None]] = {}
        for owner in (cls, *cls.toolsets):
            for attr in dir(owner):
                fn = getattr(owner, attr, None)
                info = tool_info(fn)
                if info is None or fn is None:
                    continue
                if attr in found:
                    raise ValueError(
                        f"Tool name collision: {attr!r} is defined by "
                        f"{(found[attr][2] or cls).__name__} and {owner.__name__}; "
                        "rename one of them"
                    )
                found[attr] = (fn, info, None if owner is cls else owner)
        return found

    @classmethod
    def terminal_tool_spec(cls) -> ToolSpec | None:
        terminals = [
            (n, fn) for n, (fn, info, _) in sorted(cls._tool_methods().items()) if info.terminal
        ]
        if len(terminals) > 1:
            raise ValueError(
                f"{cls.__name__} has {len(terminals)} @terminal tools "
                f"({', '.join(n for n, _ in terminals)}); at most one is allowed"
            )
        return tool_spec(*terminals[0]) if terminals else None

    @classmethod
    def terminal_tool(cls) -> TerminalToolSpec | None:
        spec = cls.terminal_tool_spec()
        return terminal_tool_from_spec(spec) if spec is not None else None

    @classmethod
    def list_tools(cls) -> ListToolsOutput:
        """The shared tools (the terminal tool is advertised separately)."""
        return ListToolsOutput(
            tools=[
                tool_spec(n, fn)
                for n, (fn, info, _) in sorted(cls._tool_methods().items())
                if info.shared and not info.terminal
            ],
            terminal_tool=cls.terminal_tool(),
            supports_score_group=cls.supports_score_group(),
        )

    def list_task_tools(self) -> ListToolsOutput | Sequence[ToolSpec]:
        """This task's own tools, beside the shared ones: by default the `@tool(shared=False)`
        ones."""
        return ListToolsOutput(
            tools=[
                tool_spec(n, fn)
                for n, (fn, info, _) in sorted(self._tool_methods().items())
                if not info.shared and not info.terminal
            ]
        )

    def bound_tool(self, name: str) -> tuple[Callable[..., Any], ToolInfo] | None:
        """The callable for tool `name`, bound to this environment or its toolset instance."""
        entry = self._tool_methods().get(name)
        if entry is None:
            return None
        _, info, owner = entry
        if owner is None:
            return getattr(self, name), info
        if owner not in self._toolset_instances:
            self._toolset_instances[owner] = owner(self)
        return getattr(self._toolset_instances[owner], name), info

    @classmethod
    def check_definition(cls) -> None:
        """Raise ValueError naming the problem if this class cannot be served."""
        methods = cls._tool_methods()  # raises on collisions
        if not methods:
            raise ValueError(
                f"environment {cls.__name__!r} has no tools; mark at least one method with @tool"
            )
        if not cls.list_splits():
            raise ValueError(
                f"environment {cls.__name__!r} has no splits; list_splits() must return at least "
                "one"
            )
        terminal_spec = cls.terminal_tool_spec()
        if terminal_spec is not None:
            fn, info, _ = methods[terminal_spec.name]
            if info.concurrent:
                raise ValueError(
                    f"@terminal tool {terminal_spec.name!r} is concurrent=True; a terminal tool "
                    "grades the episode, so it must run serialised"
                )
            fields = list((terminal_spec.input_schema or {}).get("properties", {}))
            if len(fields) > 1:
                raise ValueError(
                    f"@terminal tool {terminal_spec.name!r} takes {len(fields)} fields {fields}; "
                    "it must take at most one (the message)"
                )
        for name, (fn, _, _) in methods.items():
            input_model(fn)  # raises on *args/**kwargs
            if name.startswith("_"):
                raise ValueError(f"tool {name!r}: tool names must not start with '_'")
