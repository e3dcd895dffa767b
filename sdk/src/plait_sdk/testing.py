"""The SDK's environment contract kit.

    from plait_sdk.testing import check_sdk_environment
    def test_contract():
        check_sdk_environment(
            MyEnv, reward_range=(0.0, 1.0), solve=lambda task: [("answer", {...})]
        )

It runs the protocol kit (`plait_testing.environment`) on the environment twice, in-process and
through plait's ORS server and client over loopback HTTP, and adds what only the SDK can check:
the class definition is servable, `teardown()` ran once for every `setup()` (also when setup
fails), a tool that raises comes back as a `ToolError` (in-process and over the wire) and leaves
the session usable, and both paths see the same tasks and tools.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import Any

import attrs

from plait.api import EnvironmentError_, ToolError, ToolOutput
from plait_sdk.environment import Environment, run_user_callable, tool
from plait_sdk.local import LocalEnvironment
from plait_testing.environment import EnvironmentReport, Solver, check_environment


@attrs.define
class SDKReport:
    in_process: EnvironmentReport
    over_http: EnvironmentReport | None
    setups: int
    teardowns: int

    @property
    def episodes(self) -> int:
        return self.in_process.episodes + (self.over_http.episodes if self.over_http else 0)


@attrs.define
class _Counts:
    setups: int = 0
    teardowns: int = 0
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def add(self, field: str) -> None:
        with self.lock:
            setattr(self, field, getattr(self, field) + 1)


def _counted(
    env_cls: type[Environment],
    counts: _Counts,
    *,
    setup_fails: bool = False,
    raising_tool: bool = False,
) -> type[Environment]:
    """A subclass (same name) that counts setup/teardown, optionally failing setup or adding a
    tool that raises."""

    async def setup(self: Any) -> None:
        counts.add("setups")
        await run_user_callable(super(subclass, self).setup)
        if setup_fails:
            raise RuntimeError("contract kit: deliberate setup failure")

    async def teardown(self: Any) -> None:
        counts.add("teardowns")
        await run_user_callable(super(subclass, self).teardown)

    namespace: dict[str, Any] = {
        "setup": setup,
        "teardown": teardown,
        "__module__": env_cls.__module__,
    }
    if raising_tool:

        def plait_contract_raises(self: Any) -> ToolOutput:
            """A tool that always raises (added by the contract kit)."""
            raise RuntimeError("contract kit: deliberate tool failure")

        namespace["plait_contract_raises"] = tool(plait_contract_raises)
    subclass: type[Environment] = type(env_cls.__name__, (env_cls,), namespace)
    return subclass


def _fail(rule: str, problem: str) -> AssertionError:
    return AssertionError(f"SDK environment contract, {rule}: {problem}")


async def _raising_tool_is_returned(env: Any, task: Mapping[str, Any], where: str) -> None:
    session = await env.open(task)
    try:
        try:
            result = await session.call("plait_contract_raises", {})
        except Exception as exc:
            raise _fail(
                "tool errors are returned, not raised",
                f"{where}: a raising tool raised {type(exc).__name__}: {exc}",
            ) from exc
        if not isinstance(result, ToolError) or "deliberate tool failure" not in result.error:
            raise _fail(
                "tool errors are returned, not raised", f"{where}: a raising tool gave {result!r}"
            )
        await session.prompt()  # the session is still usable
    finally:
        await session.close()


async def _same_view(local: Any, remote: Any) -> None:
    for split in await local.splits():
        total = await local.num_tasks(split.name)
        if total != await remote.num_tasks(split.name):
            raise _fail("in-process and HTTP agree", f"num_tasks({split.name!r}) differs")
        for index in range(min(total, 2)):
            if await local.get_task(split.name, index) != await remote.get_task(split.name, index):
                raise _fail(
                    "in-process and HTTP agree", f"get_task({split.name!r}, {index}) differs"
                )
    task = await local.get_task((await local.splits())[0].name, 0)
    sessions = [await local.open(task), await remote.open(task)]
    try:
        local_tools, remote_tools = [await s.tools() for s in sessions]
        if [t.name for t in local_tools] != [t.name for t in remote_tools]:
            raise _fail("in-process and HTTP agree", "the tool lists differ")
        if await sessions[0].prompt() != await sessions[1].prompt():
            raise _fail("in-process and HTTP agree", "the prompts differ")
    finally:
        for session in sessions:
            await session.close()


async def check_sdk_environment_async(
    env_cls: type[Environment],
    *,
    reward_range: tuple[float, float] | None = None,
    solve: Solver | None = None,
    over_http: bool = True,
    **kit_options: Any,
) -> SDKReport:
    from plait_sdk.client import ORSEnvironment, ORSOptions
    from plait_sdk.server import Server

    env_cls.check_definition()
    Server([env_cls])  # the server accepts the class
    counts = _Counts()
    local = LocalEnvironment(_counted(env_cls, counts))
    in_process = await check_environment(
        local, reward_range=reward_range, solve=solve, **kit_options
    )
    task = await local.get_task((await local.splits())[0].name, 0)

    raising = LocalEnvironment(_counted(env_cls, counts, raising_tool=True))
    await _raising_tool_is_returned(raising, task, "in-process")
    failing = LocalEnvironment(_counted(env_cls, counts, setup_fails=True))
    try:
        session = await failing.open(task)
    except EnvironmentError_:
        pass
    else:
        await session.close()
        raise _fail("setup failures", "open() succeeded although setup() raised")

    over: EnvironmentReport | None = None
    if over_http:
        server = Server([_counted(env_cls, counts)])
        raising_server = Server([_counted(env_cls, counts, raising_tool=True)])
        with server.serve_in_thread() as url, raising_server.serve_in_thread() as raising_url:
            remote = ORSEnvironment(ORSOptions(url=url, ping_interval_s=1.0))
            raising_remote = ORSEnvironment(ORSOptions(url=raising_url))
            try:
                over = await check_environment(
                    remote, reward_range=reward_range, solve=solve, **kit_options
                )
                await _same_view(LocalEnvironment(_counted(env_cls, counts)), remote)
                await _raising_tool_is_returned(raising_remote, task, "over HTTP")
            finally:
                await remote.close()
                await raising_remote.close()
            await _settled(server, raising_server)
    if counts.setups != counts.teardowns:
        raise _fail(
            "teardown is always called",
            f"setup() ran {counts.setups} times but teardown() {counts.teardowns} times",
        )
    return SDKReport(in_process, over, counts.setups, counts.teardowns)


async def _settled(*servers: Any) -> None:
    """Wait (briefly) until the servers have closed every session the kit opened."""
    for _ in range(200):
        if not any(server.sessions for server in servers):
            return
        await asyncio.sleep(0.01)
    leaked = {sid for server in servers for sid in server.sessions}
    raise _fail(
        "sessions are deleted",
        f"the server still holds sessions {sorted(leaked)} after the client closed them",
    )


def check_sdk_environment(env_cls: type[Environment], **kwargs: Any) -> SDKReport:
    """`check_sdk_environment_async` for synchronous tests (runs its own event loop)."""
    return asyncio.run(check_sdk_environment_async(env_cls, **kwargs))
