"""A slow environment for benchmarks: any registered environment whose tool calls each take
`delay_s` longer (a remote verifier or sandbox; the wait is I/O, not CPU). Registered as env
"bench.slow" when this module is named in PLAIT_PLUGIN_MODULES (benchmarks/ on sys.path).

    [env]
    name = "bench.slow"
    options = { inner = "math.arith", inner_options = { preset = "tiny" }, delay_s = 4.0 }
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import attrs

from plait.hookspecs import hookimpl
from plait.plugins import build
from plait.protocols import Environment, EnvSession


@attrs.frozen(kw_only=True)
class SlowEnvOptions:
    inner: str = "math.arith"
    inner_options: dict[str, Any] = attrs.field(factory=dict)
    delay_s: float = 4.0


@attrs.define
class SlowSession:
    inner: EnvSession
    delay_s: float

    async def call(self, name: str, input: Mapping[str, Any]) -> Any:
        await asyncio.sleep(self.delay_s)
        return await self.inner.call(name, input)

    def __getattr__(self, attr: str) -> Any:  # prompt, messages, tools, terminal_tool, close
        return getattr(self.inner, attr)


@attrs.define
class SlowEnvironment:
    inner: Environment
    delay_s: float

    @property
    def name(self) -> str:
        return f"slow({self.inner.name})"

    async def open(
        self, task: Mapping[str, Any], secrets: Mapping[str, str] | None = None
    ) -> SlowSession:
        return SlowSession(await self.inner.open(task, secrets), self.delay_s)

    def __getattr__(self, attr: str) -> Any:  # splits, num_tasks, get_task, close
        return getattr(self.inner, attr)


def make_env(*, options: SlowEnvOptions) -> SlowEnvironment:
    return SlowEnvironment(
        build("env", options.inner, options=options.inner_options), options.delay_s
    )


@hookimpl
def plait_register_envs(register: Any) -> None:
    register(
        "bench.slow",
        f"{__name__}:make_env",
        options=f"{__name__}:SlowEnvOptions",
        description="a registered environment with slow tool calls (benchmarks)",
    )
