"""The SDK surface: decorators, schemas, sessions (concurrency, latch), porting, the contract
kit."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel

from plait.api import EnvironmentError_, ToolError, ToolOutput
from plait_sdk import (
    Environment,
    ListToolsOutput,
    LocalEnvironment,
    Split,
    TextBlock,
    Toolset,
    terminal,
    tool,
)
from plait_sdk.testing import check_sdk_environment
from plait_testing.environment import run_environment_contract


class Guess(BaseModel):
    number: int


class Counter(Environment):
    """Counts calls; used to check the session's concurrency rules."""

    reward_range = (0.0, 1.0)

    def setup(self) -> None:
        self.log: list[str] = []
        self.active = 0
        self.peak = 0

    @classmethod
    def list_splits(cls) -> list[str]:
        return ["train", "custom"]

    @classmethod
    def list_tasks(cls, split: str) -> list[dict]:
        return [{"n": i} for i in range(3)]

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(f"task {self.task_spec['n']}")]

    async def _work(self, name: str, seconds: float) -> None:
        self.active += 1
        self.peak = max(self.peak, self.active)
        self.log.append(f"start {name}")
        await asyncio.sleep(seconds)
        self.log.append(f"end {name}")
        self.active -= 1

    @tool
    async def slow(self, seconds: float = 0.05) -> ToolOutput:
        """Serialised per tool (the default)."""
        await self._work("slow", seconds)
        return ToolOutput(blocks=[TextBlock("slow")])

    @tool(concurrent=True)
    async def read(self, seconds: float = 0.05) -> ToolOutput:
        """Overlaps freely."""
        await self._work("read", seconds)
        return ToolOutput(blocks=[TextBlock("read")])

    @tool(exclusive=True)
    async def submit(self, guess: Guess) -> ToolOutput:
        """Waits for every in-flight call; ends the episode."""
        await self._work("submit", 0.01)
        return ToolOutput(
            blocks=[TextBlock("done")],
            reward=float(guess.number == self.task_spec["n"]),
            finished=True,
        )

    @tool(shared=False)
    def secret(self) -> str:
        """A per-task tool (a plain string result is wrapped)."""
        return f"n={self.task_spec['n']}"


def run(coro):
    return asyncio.run(coro)


def test_schemas_come_from_type_hints_and_pydantic_models() -> None:
    specs = {t.name: t for t in Counter.list_tools()}
    assert sorted(specs) == ["read", "slow", "submit"]  # "secret" is per task
    assert specs["slow"].input_schema == {
        "additionalProperties": False,
        "type": "object",
        "properties": {"seconds": {"default": 0.05, "title": "Seconds", "type": "number"}},
    }
    assert specs["submit"].input_schema["required"] == ["number"]
    assert specs["slow"].description == "Serialised per tool (the default)."
    assert isinstance(Counter.list_tools(), ListToolsOutput) and len(Counter.list_tools()) == 3


def test_session_lists_task_tools_and_wraps_strings() -> None:
    async def go() -> None:
        session = await LocalEnvironment(Counter).open({"n": 2})
        assert [t.name for t in await session.tools()] == ["read", "slow", "submit", "secret"]
        out = await session.call("secret", {})
        assert isinstance(out, ToolOutput) and out.text == "n=2"
        await session.close()

    run(go())


def test_one_tool_runs_one_call_at_a_time_but_concurrent_tools_overlap() -> None:
    async def go() -> tuple[list[str], int]:
        session = await LocalEnvironment(Counter).open({"n": 0})
        await asyncio.gather(session.call("slow", {}), session.call("slow", {}))
        serial_log = list(session.env.log)
        session.env.peak = 0
        await asyncio.gather(*(session.call("read", {}) for _ in range(3)))
        peak = session.env.peak
        await session.close()
        return serial_log, peak

    serial_log, peak = run(go())
    assert serial_log == ["start slow", "end slow", "start slow", "end slow"]
    assert peak == 3


def test_exclusive_tool_waits_for_in_flight_calls_and_latches_the_episode() -> None:
    async def go() -> tuple[list, list[str]]:
        session = await LocalEnvironment(Counter).open({"n": 1})
        first = asyncio.ensure_future(session.call("read", {"seconds": 0.1}))
        await asyncio.sleep(0.02)
        results = await asyncio.gather(
            session.call("submit", {"number": 1}), session.call("slow", {}), first
        )
        after = await session.call("read", {})
        log = list(session.env.log)
        await session.close()
        return [*results, after], log

    (submitted, queued, first, after), log = run(go())
    assert log[:3] == ["start read", "end read", "start submit"]  # submit waited for the read
    assert isinstance(submitted, ToolOutput) and submitted.reward == 1.0 and submitted.finished
    assert isinstance(first, ToolOutput)
    for refused in (queued, after):  # queued behind the finishing call, or after it: never run
        assert isinstance(refused, ToolError) and refused.reason == "episode_finished"
    assert "start slow" not in log


def test_user_code_runs_in_threads_and_the_sdks_defaults_inline() -> None:
    """Sync user methods must not block the event loop; the SDK's own defaults (constructor,
    teardown, task tools) hold no user code and spare each episode the thread hops."""
    import threading

    seen: dict[str, bool] = {}

    class Watched(Counter):
        def setup(self) -> None:
            super().setup()
            seen["setup in a thread"] = threading.current_thread() is not threading.main_thread()

        def teardown(self) -> None:
            seen["teardown in a thread"] = threading.current_thread() is not threading.main_thread()

    async def go(env_cls: type[Environment]) -> int:
        hops = 0
        to_thread = asyncio.to_thread

        async def counting(*args: object, **kwargs: object) -> object:
            nonlocal hops
            hops += 1
            return await to_thread(*args, **kwargs)

        asyncio.to_thread = counting  # type: ignore[assignment]
        try:
            session = await LocalEnvironment(env_cls).open({"n": 1})
            await session.tools()
            await session.close()
        finally:
            asyncio.to_thread = to_thread
        return hops

    assert run(go(Watched)) == 2  # setup and teardown, the user's
    assert seen == {"setup in a thread": True, "teardown in a thread": True}
    assert (
        run(go(Counter)) == 1
    )  # setup only: its constructor, teardown and task tools are the SDK's


def test_tool_failures_come_back_as_tool_errors() -> None:
    class Broken(Counter):
        @tool
        def boom(self) -> ToolOutput:
            raise ValueError("kaput")

    async def go() -> list:
        session = await LocalEnvironment(Broken).open({"n": 0})
        results = [
            await session.call("boom", {}),
            await session.call("nope", {}),
            await session.call("submit", {"number": "x"}),
            await session.call("secret", {"x": 1}),
        ]
        await session.close()
        await session.close()
        results.append(await session.call("read", {}))
        return results

    boom, unknown, invalid, extra, closed = run(go())
    assert (boom.reason, unknown.reason, invalid.reason, extra.reason, closed.reason) == (
        "exception",
        "not_found",
        "input_validation",
        "input_validation",
        "episode_finished",
    )
    assert "kaput" in boom.error and "number" in invalid.error


def test_teardown_runs_when_setup_fails() -> None:
    torn_down = []

    class FailingSetup(Counter):
        def setup(self) -> None:
            raise RuntimeError("no sandbox")

        def teardown(self) -> None:
            torn_down.append(True)

    with pytest.raises(EnvironmentError_, match="setup failed: RuntimeError: no sandbox"):
        run(LocalEnvironment(FailingSetup).open({"n": 0}))
    assert torn_down == [True]


def test_terminal_tool_is_hidden_and_advertised() -> None:
    class Final(Counter):
        @terminal
        @tool
        def final(self, answer: str) -> ToolOutput:
            return ToolOutput(blocks=[TextBlock(answer)], reward=1.0, finished=True)

    assert "final" not in [t.name for t in Final.list_tools()]
    assert Final.list_tools().terminal_tool.arg == "answer"

    async def go() -> ToolOutput:
        session = await LocalEnvironment(Final).open({"n": 0})
        assert (await session.terminal_tool()).name == "final"
        out = await session.call("final", {"answer": "42"})
        await session.close()
        return out

    assert run(go()).finished


def test_definition_errors_name_the_problem() -> None:
    class Shared(Toolset):
        @tool
        def read(self) -> ToolOutput:
            return ToolOutput()

    class Clash(Counter):
        toolsets = [Shared]

    with pytest.raises(ValueError, match="Tool name collision: 'read'"):
        Clash.check_definition()

    class NoTools(Environment):
        @classmethod
        def list_splits(cls) -> list[str]:
            return ["train"]

        @classmethod
        def list_tasks(cls, split: str) -> list[dict]:
            return []

        def get_prompt(self) -> list[TextBlock]:
            return []

    with pytest.raises(ValueError, match="has no tools"):
        LocalEnvironment(NoTools)
    with pytest.raises(ValueError, match="contradicts itself"):
        tool(concurrent=True, exclusive=True)


def test_custom_split_names_get_the_validation_type() -> None:
    assert Counter.splits() == [Split("train", "train"), Split("custom", "validation")]


def test_contract_kit_in_process_and_over_http() -> None:
    report = check_sdk_environment(
        Counter, solve=lambda task: [("read", {}), ("submit", {"number": task["n"]})]
    )
    assert report.in_process.episodes_finished == 3 and report.over_http.episodes_finished == 3
    assert report.setups == report.teardowns > 0
    assert report.in_process.rewards.count(1.0) == 3


def test_contract_kit_catches_a_reward_out_of_range() -> None:
    class Greedy(Counter):
        @tool
        def cheat(self) -> ToolOutput:
            return ToolOutput(blocks=[TextBlock("$$$")], reward=5.0, finished=True)

    with pytest.raises(AssertionError, match=r"outside \[0.0, 1.0\]"):
        run_environment_contract(LocalEnvironment(Greedy), solve=lambda task: [("cheat", {})])


def test_contract_kit_catches_a_missing_latch() -> None:
    class NoLatch:
        """A hand-written protocol implementation that forgets the finished latch."""

        name = "nolatch"

        async def splits(self):
            return [Split("train")]

        async def num_tasks(self, split):
            if split != "train":
                raise KeyError(split)
            return 1

        async def get_task(self, split, index):
            if split != "train" or index != 0:
                raise IndexError(index)
            return {"x": 1}

        async def open(self, task, secrets=None):
            inner = await LocalEnvironment(Counter).open({"n": 0})

            class Session:
                prompt, messages, tools, terminal_tool, close = (
                    inner.prompt,
                    inner.messages,
                    inner.tools,
                    inner.terminal_tool,
                    inner.close,
                )

                async def call(self, name, args):
                    inner.finished = False  # the bug: the latch is reset
                    return await inner.call(name, args)

            return Session()

        async def close(self):
            pass

    with pytest.raises(AssertionError, match="finished latch"):
        run_environment_contract(NoLatch(), solve=lambda task: [("submit", {"number": 0})])


def test_an_ors_environment_ports_by_changing_its_import(ported_env: type) -> None:
    answers = {"t0": "42", "t1": "72", "t2": "63", "t3": "12", "h0": "42"}
    report = check_sdk_environment(
        ported_env,
        reward_range=(-1.0, 1.0),
        solve=lambda task: [
            ("hint", {}),
            ("note", {"text": "x"}),
            ("answer", {"answer": answers[task["id"]]}),
        ],
    )
    assert report.in_process.episodes_finished == 3 and report.over_http.episodes_finished == 3
    assert report.in_process.rewards[-3:] == [-0.1, 0.0, 1.0]
