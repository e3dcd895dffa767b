"""The environment base class and the `@tool` decorator.

The surface matches the `ors` package (ors-sdk): subclass `Environment`, implement `get_prompt`,
`list_splits` and `list_tasks`, and mark actions with `@tool`. A tool takes either no argument,
one pydantic model (the ORS style), or plain typed keyword arguments (the input schema is derived
from the type hints), and returns a `ToolOutput` (a plain string is wrapped into one).

Additions over ors-sdk, from the `openreward` SDK: `@tool(concurrent=..., exclusive=...)`, a
`@terminal` tool that receives a plain-text final answer, `get_messages()`, and the finished latch
(enforced by the session, see `plait_sdk.local`).
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, get_type_hints

import pydantic

from plait.types import Block, Message, Split, TextBlock, ToolOutput, ToolSpec, blocks_text

JSONObject = Mapping[str, Any]

_TOOL_ATTR = "_plait_tool"


class ToolInfo:
    """What `@tool` records about a method."""

    def __init__(self, *, shared: bool, concurrent: bool, exclusive: bool, terminal: bool) -> None:
        self.shared = shared
        self.concurrent = concurrent
        self.exclusive = exclusive
        self.terminal = terminal


def tool(fn: Callable[..., Any] | None = None, *, shared: bool = True, concurrent: bool = False,
         exclusive: bool = False) -> Any:
    """Mark a method as a tool.

    shared=False makes it a per-task tool (listed by `task_tools`, not `tools`); concurrent=True
    lets calls of it overlap within a session; exclusive=True waits for all other calls first.
    """

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        setattr(f, _TOOL_ATTR, ToolInfo(shared=shared, concurrent=concurrent, exclusive=exclusive, terminal=False))
        return f

    return mark(fn) if fn is not None else mark


def terminal(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark the tool that receives the model's plain-text final answer (one string argument).

    It is hidden from the tool list and advertised as the terminal tool: a rollout that ends with a
    message and no tool call passes that message's text to it.
    """
    setattr(fn, _TOOL_ATTR, ToolInfo(shared=True, concurrent=False, exclusive=False, terminal=True))
    return fn


def tool_info(fn: Any) -> ToolInfo | None:
    return getattr(fn, _TOOL_ATTR, None) if callable(fn) else None


def _params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    real = inspect.unwrap(fn)
    return [p for p in inspect.signature(real).parameters.values() if p.name != "self"]


@functools.cache
def input_model(fn: Callable[..., Any]) -> type[pydantic.BaseModel] | None:
    """The pydantic model that validates a tool's input (None for a tool without arguments)."""
    real = inspect.unwrap(fn)
    params = _params(real)
    if not params:
        return None
    hints = get_type_hints(real, include_extras=True)
    if len(params) == 1 and inspect.isclass(hints.get(params[0].name)) and issubclass(
        hints[params[0].name], pydantic.BaseModel
    ):
        return hints[params[0].name]
    fields: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"tool {real.__name__!r}: *args/**kwargs cannot be described by a schema")
        annotation = hints.get(p.name, Any)
        fields[p.name] = (annotation, ... if p.default is p.empty else p.default)
    model = pydantic.create_model(
        f"{real.__name__}_input", __config__=pydantic.ConfigDict(extra="forbid"), **fields
    )
    model.__plait_kwargs__ = True  # type: ignore[attr-defined]
    return model


def tool_spec(name: str, fn: Callable[..., Any]) -> ToolSpec:
    model = input_model(fn)
    schema = model.model_json_schema() if model is not None else None
    if schema is not None:
        schema.pop("title", None)  # the official clients choke on extra keys such as title
    return ToolSpec(name=name, description=inspect.cleandoc(fn.__doc__ or ""), input_schema=schema)


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class Toolset(ABC):  # noqa: B024 - a marker base, as in ors
    """A reusable collection of tools; list it in an environment's `toolsets`."""

    def __init__(self, env: Any) -> None:
        self.env = env


class Environment(ABC):
    """An RL environment: tasks in splits, a prompt per task, and tools that act and reward."""

    toolsets: ClassVar[Sequence[type]] = ()

    def __init__(self, task_spec: JSONObject | None = None, secrets: Mapping[str, str] | None = None) -> None:
        self.task_spec: JSONObject = dict(task_spec or {})
        self.secrets: Mapping[str, str] = dict(secrets or {})
        self._toolset_instances: dict[type, Any] = {}

    # -- lifecycle -------------------------------------------------------------------------

    def setup(self) -> Awaitable[None] | None:
        """Prepare the episode (runs once, before the first prompt or call)."""

    def teardown(self) -> Awaitable[None] | None:
        """Release what setup acquired; always called, also after a failure."""

    # -- tasks -----------------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def list_splits(cls) -> Sequence[Split | str]:
        """The split names (or Split objects)."""

    @classmethod
    @abstractmethod
    def list_tasks(cls, split: str) -> Sequence[JSONObject] | Awaitable[Sequence[JSONObject]]:
        """Every task of `split`. Override `num_tasks`/`get_task` instead for large or procedural splits."""

    @classmethod
    async def num_tasks(cls, split: str) -> int:
        return len(await maybe_await(cls.list_tasks(split)))

    @classmethod
    async def get_task(cls, split: str, index: int) -> JSONObject:
        tasks = await maybe_await(cls.list_tasks(split))
        return tasks[index]

    @classmethod
    def splits(cls) -> list[Split]:
        out = []
        for s in cls.list_splits():
            if isinstance(s, Split):
                out.append(s)
            else:
                out.append(Split(s, s if s in ("train", "validation", "test") else "validation"))
        return out

    # -- prompt ----------------------------------------------------------------------------

    @abstractmethod
    def get_prompt(self) -> Sequence[Block] | Awaitable[Sequence[Block]]:
        """The task's prompt as text/image blocks."""

    async def get_messages(self) -> list[Message]:
        """The opening chat messages; by default the prompt as one user message."""
        blocks = await maybe_await(self.get_prompt())
        return [Message("user", blocks_text(blocks))]

    # -- tools -----------------------------------------------------------------------------

    @classmethod
    def name(cls) -> str:
        return cls.__name__.lower()

    @classmethod
    def _tool_methods(cls) -> dict[str, tuple[Callable[..., Any], ToolInfo, type | None]]:
        """Tool name -> (function, info, owning toolset or None). Raises on name collisions."""
        found: dict[str, tuple[Callable[..., Any], ToolInfo, type | None]] = {}
        for owner in (cls, *cls.toolsets):
            for attr in dir(owner):
                fn = getattr(owner, attr, None)
                info = tool_info(fn)
                if info is None:
                    continue
                if attr in found:
                    raise ValueError(
                        f"tool name collision: {attr!r} is defined by "
                        f"{(found[attr][2] or cls).__name__} and {owner.__name__}"
                    )
                found[attr] = (fn, info, None if owner is cls else owner)
        return found

    @classmethod
    def list_tools(cls) -> list[ToolSpec]:
        """The shared tools (the terminal tool is advertised separately)."""
        return [tool_spec(n, fn) for n, (fn, info, _) in sorted(cls._tool_methods().items())
                if info.shared and not info.terminal]

    def list_task_tools(self) -> list[ToolSpec]:
        """Shared tools plus this task's own (`@tool(shared=False)`)."""
        return [tool_spec(n, fn) for n, (fn, info, _) in sorted(self._tool_methods().items())
                if not info.terminal]

    @classmethod
    def terminal_tool(cls) -> ToolSpec | None:
        for name, (fn, info, _) in sorted(cls._tool_methods().items()):
            if info.terminal:
                return tool_spec(name, fn)
        return None

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


def as_tool_output(name: str, result: Any) -> ToolOutput:
    if isinstance(result, ToolOutput):
        return result
    if isinstance(result, str):
        return ToolOutput(blocks=[TextBlock(result)])
    raise TypeError(f"tool {name!r} returned {type(result).__name__}; expected ToolOutput (or str)")
