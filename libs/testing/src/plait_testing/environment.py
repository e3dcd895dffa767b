"""The environment contract kit: checks every `plait.protocols.Environment` must pass.

    from plait_testing.environment import run_environment_contract
    report = run_environment_contract(my_env, reward_range=(0.0, 1.0), solve=my_solver)

What it checks (each failure is an AssertionError that names the rule and what broke it):

- splits: a non-empty list of `Split`, unique names;
- tasks are reproducible by index: `get_task(split, i)` twice gives equal, JSON-serialisable
  objects, and an index out of range or an unknown split raises instead of returning something;
- sessions: `prompt()` gives text/image blocks, `messages()` gives `Message`s, tool names are
  unique, every tool's `input_schema` is a valid JSON Schema of an object, the terminal tool (if
  any) is not in the tool list;
- tool errors are returned, not raised: an unknown tool, an invalid input, a call after the
  episode finished and a call after `close()` all come back as `ToolError`;
- rewards are finite and, when a range is declared, inside it;
- the finished latch: after a result with `finished=True` every call is refused
  (`ToolError(reason="episode_finished")`);
- `close()` is always safe: twice, right after `open()`, after the episode; `Environment.close()`
  too.

`solve(task)` (optional) gives the (tool, input) calls that play a task to its end; without it the
kit calls each tool with the smallest input its schema allows, for up to `max_steps` calls.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from plait.api import ImageBlock, Message, Split, TextBlock, ToolError, ToolOutput, ToolSpec

Action = tuple[str, Mapping[str, Any]]
Solver = Callable[[Mapping[str, Any]], Sequence[Action]]


@attrs.define
class EnvironmentReport:
    """What the kit exercised (so a test can assert it did real work)."""

    splits: list[str] = attrs.field(factory=list)
    tasks_checked: int = 0
    sessions: int = 0
    episodes_finished: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    rewards: list[float] = attrs.field(factory=list)

    @property
    def episodes(self) -> int:
        return self.episodes_finished


def _fail(rule: str, problem: str) -> AssertionError:
    return AssertionError(f"environment contract, {rule}: {problem}")


def _check(condition: bool, rule: str, problem: str) -> None:
    if not condition:
        raise _fail(rule, problem)


def check_json_schema(schema: Any, where: str) -> None:
    """`schema` is a valid JSON Schema (2020-12) describing an object."""
    try:
        import jsonschema
    except ImportError as exc:  # pragma: no cover - jsonschema is a test dependency of plait
        raise RuntimeError(
            "the environment contract kit needs jsonschema: pip install jsonschema"
        ) from exc
    _check(
        isinstance(schema, Mapping),
        "tool schemas",
        f"{where}: input_schema must be an object, got {schema!r}",
    )
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise _fail(
            "tool schemas", f"{where}: input_schema is not valid JSON Schema: {exc.message}"
        ) from None
    _check(
        schema.get("type", "object") == "object",
        "tool schemas",
        f"{where}: input_schema must describe an object (tool input is a JSON object), got type "
        f"{schema.get('type')!r}",
    )


def example_input(schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """The smallest input a tool's schema accepts: its required properties, each a plain value."""
    if not schema:
        return {}
    defs = schema.get("$defs", {})
    properties = schema.get("properties", {})
    return {
        name: _example_value(properties.get(name, {}), defs) for name in schema.get("required", [])
    }


def _example_value(schema: Mapping[str, Any], defs: Mapping[str, Any]) -> Any:
    if "$ref" in schema:
        return _example_value(defs.get(schema["$ref"].rsplit("/", 1)[-1], {}), defs)
    if "default" in schema:
        return schema["default"]
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        options = [o for o in schema.get(key, []) if o.get("type") != "null"]
        if options:
            return _example_value(options[0], defs)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind is None:
        return None
    minimum = schema.get("minimum", 0)
    return {
        "string": "0" * int(schema.get("minLength", 1)),
        "integer": math.ceil(minimum) if isinstance(minimum, int | float) else 0,
        "number": float(minimum) if isinstance(minimum, int | float) else 0.0,
        "boolean": False,
        "array": [],
        "object": example_input(schema) if schema.get("properties") else {},
    }.get(kind)


def _invalid_input(tools: Sequence[ToolSpec]) -> tuple[str, dict[str, Any]] | None:
    """A call that must fail validation: a tool with required fields, called without them."""
    for spec in tools:
        if spec.input_schema and spec.input_schema.get("required"):
            return spec.name, {}
    return None


class _Episode:
    """Plays one session and checks every answer."""

    def __init__(
        self, session: Any, report: EnvironmentReport, reward_range: tuple[float, float] | None
    ) -> None:
        self.session = session
        self.report = report
        self.reward_range = reward_range

    async def call(self, name: str, args: Mapping[str, Any]) -> ToolOutput | ToolError:
        try:
            result = await self.session.call(name, args)
        except Exception as exc:
            raise _fail(
                "tool errors are returned, not raised",
                f"call({name!r}, {dict(args)!r}) raised {type(exc).__name__}: {exc}",
            ) from exc
        self.report.tool_calls += 1
        _check(
            isinstance(result, ToolOutput | ToolError),
            "tool results",
            f"call({name!r}) returned {type(result).__name__}, expected ToolOutput or ToolError",
        )
        if isinstance(result, ToolError):
            self.report.tool_errors += 1
            _check(
                bool(result.error),
                "tool errors",
                f"call({name!r}) returned a ToolError without a message",
            )
            return result
        _check(
            all(isinstance(b, TextBlock | ImageBlock) for b in result.blocks),
            "tool results",
            f"call({name!r}) returned blocks that are not TextBlock/ImageBlock: {result.blocks!r}",
        )
        if result.reward is not None:
            reward = result.reward
            _check(
                isinstance(reward, int | float) and math.isfinite(reward),
                "rewards are finite",
                f"call({name!r}) returned reward {reward!r}",
            )
            if self.reward_range is not None:
                low, high = self.reward_range
                _check(
                    low <= reward <= high,
                    "rewards are in the declared range",
                    f"call({name!r}) returned reward {reward}, outside [{low}, {high}]",
                )
            self.report.rewards.append(float(reward))
        if result.metadata is not None:
            try:
                json.dumps(result.metadata)
            except (TypeError, ValueError) as exc:
                raise _fail("tool results", f"call({name!r}) metadata is not JSON: {exc}") from None
        return result

    async def expect_refused(
        self, name: str, args: Mapping[str, Any], rule: str, reason: str | None
    ) -> None:
        result = await self.call(name, args)
        _check(isinstance(result, ToolError), rule, f"call({name!r}) ran and returned {result!r}")
        assert isinstance(result, ToolError)
        if reason is not None:
            _check(
                result.reason == reason,
                rule,
                f"call({name!r}) gave reason {result.reason!r}, expected {reason!r}",
            )


async def _check_session_surface(session: Any) -> tuple[list[ToolSpec], ToolSpec | None]:
    blocks = await session.prompt()
    _check(
        isinstance(blocks, list) and all(isinstance(b, TextBlock | ImageBlock) for b in blocks),
        "prompt",
        f"prompt() must return a list of TextBlock/ImageBlock, got {blocks!r}",
    )
    messages = await session.messages()
    _check(
        isinstance(messages, list)
        and all(isinstance(m, Message) for m in messages)
        and bool(messages),
        "messages",
        f"messages() must return a non-empty list of Message, got {messages!r}",
    )
    tools = await session.tools()
    _check(
        isinstance(tools, list) and all(isinstance(t, ToolSpec) for t in tools),
        "tools",
        f"tools() must return a list of ToolSpec, got {tools!r}",
    )
    names = [t.name for t in tools]
    _check(len(names) == len(set(names)), "tools", f"tool names repeat: {names}")
    for spec in tools:
        if spec.input_schema is not None:
            check_json_schema(spec.input_schema, f"tool {spec.name!r}")
    terminal = await session.terminal_tool()
    if terminal is not None:
        _check(
            isinstance(terminal, ToolSpec),
            "terminal tool",
            f"terminal_tool() returned {terminal!r}",
        )
        _check(
            terminal.name not in names,
            "terminal tool",
            f"terminal tool {terminal.name!r} must not appear in tools()",
        )
        if terminal.input_schema is not None:
            check_json_schema(terminal.input_schema, f"terminal tool {terminal.name!r}")
    _check(
        bool(tools) or terminal is not None,
        "tools",
        "a session has neither tools nor a terminal tool",
    )
    return tools, terminal


def _generated_actions(
    tools: Sequence[ToolSpec], terminal: ToolSpec | None, steps: int
) -> list[Action]:
    callable_tools = [*tools, *([terminal] if terminal is not None else [])]
    return [
        (spec.name, example_input(spec.input_schema))
        for spec in (callable_tools[i % len(callable_tools)] for i in range(steps))
    ]


async def _close_twice(session: Any, where: str) -> None:
    for attempt in ("first", "second"):
        try:
            await session.close()
        except Exception as exc:
            raise _fail(
                "close is always safe",
                f"{where}: the {attempt} close() raised {type(exc).__name__}: {exc}",
            ) from exc


async def check_environment(
    env: Any,
    *,
    reward_range: tuple[float, float] | None = None,
    solve: Solver | None = None,
    max_tasks_per_split: int = 3,
    max_episodes: int = 3,
    max_steps: int = 12,
) -> EnvironmentReport:
    """Run every check on `env`; returns what was exercised, raises AssertionError on a breach."""
    if reward_range is None:
        reward_range = getattr(env, "reward_range", None)
    report = EnvironmentReport()
    _check(
        isinstance(getattr(env, "name", None), str) and env.name,
        "name",
        "env.name must be a non-empty string",
    )
    splits = await env.splits()
    _check(
        isinstance(splits, list) and bool(splits) and all(isinstance(s, Split) for s in splits),
        "splits",
        f"splits() must return a non-empty list of Split, got {splits!r}",
    )
    report.splits = [s.name for s in splits]
    _check(
        len(set(report.splits)) == len(report.splits),
        "splits",
        f"split names repeat: {report.splits}",
    )

    tasks: list[dict[str, Any]] = []
    for split in splits:
        total = await env.num_tasks(split.name)
        _check(
            isinstance(total, int) and not isinstance(total, bool) and total >= 0,
            "tasks",
            f"num_tasks({split.name!r}) returned {total!r}",
        )
        for index in range(min(total, max_tasks_per_split)):
            first, again = (
                await env.get_task(split.name, index),
                await env.get_task(split.name, index),
            )
            _check(
                isinstance(first, Mapping),
                "tasks",
                f"get_task({split.name!r}, {index}) returned {first!r}",
            )
            try:
                encoded = json.dumps(first, sort_keys=True)
            except (TypeError, ValueError) as exc:
                raise _fail(
                    "tasks are JSON", f"get_task({split.name!r}, {index}) is not JSON: {exc}"
                ) from None
            _check(
                encoded == json.dumps(again, sort_keys=True),
                "tasks are reproducible by index",
                f"get_task({split.name!r}, {index}) gave {first!r}, then {again!r}",
            )
            tasks.append(dict(first))
            report.tasks_checked += 1
        await _expect_raises(
            env.get_task(split.name, total),
            "an index out of range raises",
            f"get_task({split.name!r}, {total}) with {total} tasks",
        )
    await _expect_raises(
        env.get_task("plait-contract-no-such-split", 0),
        "an unknown split raises",
        "get_task('plait-contract-no-such-split', 0)",
    )
    _check(bool(tasks), "tasks", f"no split has a task (splits {report.splits})")

    # A session closed right after open, twice.
    session = await env.open(tasks[0])
    report.sessions += 1
    await _close_twice(session, "a session closed right after open()")

    for task in tasks[:max_episodes]:
        await _play(env, task, report, reward_range, solve, max_steps)

    await _close_twice(env, "Environment.close()")
    return report


async def _play(
    env: Any,
    task: dict[str, Any],
    report: EnvironmentReport,
    reward_range: tuple[float, float] | None,
    solve: Solver | None,
    max_steps: int,
) -> None:
    session = await env.open(task)
    report.sessions += 1
    episode = _Episode(session, report, reward_range)
    try:
        tools, terminal = await _check_session_surface(session)
        await episode.expect_refused(
            "plait_contract_no_such_tool", {}, "an unknown tool is a ToolError", "not_found"
        )
        invalid = _invalid_input(tools)
        if invalid is not None:
            await episode.expect_refused(
                *invalid, "an invalid input is a ToolError", "input_validation"
            )
        actions = (
            list(solve(task))
            if solve is not None
            else _generated_actions(tools, terminal, max_steps)
        )
        finished_by: str | None = None
        for name, args in actions:
            result = await episode.call(name, args)
            if isinstance(result, ToolOutput) and result.finished:
                finished_by = name
                break
        if solve is not None:
            _check(
                finished_by is not None,
                "solve",
                f"the calls solve() gave for task {task!r} never finished the episode",
            )
        if finished_by is not None:
            report.episodes_finished += 1
            name, args = actions[0]
            await episode.expect_refused(
                name,
                args,
                "the finished latch refuses calls after finished=True",
                "episode_finished",
            )
    finally:
        await _close_twice(session, "a session after its episode")
    after_close = await episode.call("plait_contract_no_such_tool", {})
    _check(
        isinstance(after_close, ToolError),
        "a call after close is a ToolError",
        f"got {after_close!r}",
    )


async def _expect_raises(awaitable: Any, rule: str, what: str) -> None:
    try:
        value = await awaitable
    except Exception:
        return
    raise _fail(rule, f"{what} returned {value!r} instead of raising")


def run_environment_contract(env: Any, **kwargs: Any) -> EnvironmentReport:
    """`check_environment` for synchronous tests (runs its own event loop)."""
    return asyncio.run(check_environment(env, **kwargs))
