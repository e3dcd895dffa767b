"""`proxy.harness`: an environment whose episodes are an unmodified agent program.

Each episode opens a session of the task environment (`tasks`, any registered environment, e.g.
`math.arith`), runs the agent with the task's prompt and its model calls pointed at a proxy
session, and hands the agent's answer to the task's terminal tool, which scores it. The agent is
either a program (`command`: the prompt in `PLAIT_PROMPT`, the session in `OPENAI_BASE_URL`,
`ANTHROPIC_BASE_URL` and both API keys; its answer is the last line it prints) or, to save a
process start per episode, a function called in this process (`function = "module:name"`, given
an `AgentEpisode` with the same values; its answer is what it returns). The trajectory is what
the proxy recorded of that session: the token ids the engine sampled, so the agent trains like
any in-process episode (GRPO groups, advantages, TITO).

The program brings its own tools (a harness's tools are its business); the task environment only
provides the prompt and the verifier. The run's sampling settings (temperature, top_p, top_k,
max_tokens, a seed per call) replace what the program asks for, as RL needs; `max_turns` caps
its model calls. A program that fails having made no model call costs its episode (recorded as
an error); one that fails after calls is scored on what it printed. The engine failing on one of
its calls raises EngineError: plait's own failure, not the episode's.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Mapping
from typing import Any

import attrs
import structlog

from plait.api import (
    DataError,
    EngineError,
    Environment,
    EnvSession,
    EpisodeConfig,
    InferenceEngine,
    Message,
    Renderer,
    Split,
    ToolError,
    ToolOutput,
    Trajectory,
    build,
    is_correct,
    load_target,
    reduce_rewards,
    terminal_argument,
)
from plait_proxy.app import ProxyApp, ServeOptions
from plait_proxy.chat import ChatRequest, Completion, RequestError
from plait_proxy.proxy import Limits, Proxy
from plait_proxy.store import ProxySession, RolloutStore, SessionPolicy

log = structlog.get_logger("plait.proxy.harness")


class _WatchedProxy(Proxy):
    """A proxy that remembers, per session, a failure of the engine or renderer: the client only
    sees a 502, but the episode must not pass it off as the environment's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failures: dict[str, Exception] = {}

    async def complete(self, session: ProxySession, request: ChatRequest, api: str) -> Completion:
        try:
            return await super().complete(session, request, api)
        except (RequestError, DataError):  # the request's fault, answered to the client
            raise
        except Exception as exc:
            self.failures[session.id] = exc
            raise


class EpisodeProxy:
    """What an environment whose episodes are programs needs: one proxy per (engine, renderer),
    started on first use in the episodes' event loop, and a recorded session per episode."""

    def __init__(self, model_name: str, max_context_tokens: int) -> None:
        self.model_name = model_name
        self.max_context_tokens = max_context_tokens
        for chatty in ("httpx", "httpx2"):  # HTTP clients log every request at INFO
            logging.getLogger(chatty).setLevel(logging.WARNING)
        self.store = RolloutStore(auto_create=False)
        self._proxies: list[_WatchedProxy] = []
        self._served: dict[tuple[int, int], str] = {}
        self._servers: contextlib.AsyncExitStack | None = None
        self._starting = asyncio.Lock()  # a batch's episodes all ask for the proxy at once

    async def url(self, engine: InferenceEngine, renderer: Renderer) -> str:
        """The proxy serving `engine` with `renderer`, started on first use (in this event loop)."""
        key = (id(engine), id(renderer))
        async with self._starting:
            if key not in self._served:
                if self._servers is None:
                    self._servers = contextlib.AsyncExitStack()
                proxy = _WatchedProxy(
                    engine,
                    renderer,
                    self.model_name,
                    Limits(max_context_tokens=self.max_context_tokens),
                )
                self._proxies.append(proxy)
                app = ProxyApp(proxy, self.store, ServeOptions(port=0, any_model=True))
                self._served[key] = await self._servers.enter_async_context(app.serving())
        return self._served[key]

    @contextlib.asynccontextmanager
    async def session(self, config: EpisodeConfig) -> AsyncIterator[ProxySession]:
        """An episode's session under the run's sampling and budget of calls, gone afterwards;
        raises EngineError if the engine failed on one of its calls."""
        session = self.store.open()
        session.policy = SessionPolicy(config.sampling, config.max_turns)
        try:
            yield session
        finally:
            self.store.discard(session.id)
            failures = [
                p.failures.pop(session.id) for p in self._proxies if session.id in p.failures
            ]
            if failures:  # outranks whatever the program made of the 502 it got
                raise EngineError(
                    f"the inference engine failed: {type(failures[0]).__name__}: {failures[0]}"
                ) from failures[0]

    async def close(self) -> None:
        if self._servers is not None:
            await self._servers.aclose()
            self._servers = None
            self._served.clear()
            self._proxies.clear()


@attrs.frozen(kw_only=True)
class HarnessOptions:
    tasks: str
    """The registered environment whose tasks, prompts and verifier the episodes use."""
    task_options: dict[str, Any] = attrs.field(factory=dict)
    command: list[str] = attrs.field(factory=list)
    """The agent program's argv; "{python}" stands for this Python interpreter."""
    function: str | None = None
    """Instead of `command`: "module:name" of a function (sync or async) taking an `AgentEpisode`
    and returning the answer."""
    env: dict[str, str] = attrs.field(factory=dict)
    """More environment variables for the program (it inherits this process's)."""
    timeout_s: float = 300.0
    model_name: str = "plait"
    """What /v1/models reports and PLAIT_MODEL holds (any name is accepted in requests)."""
    max_context_tokens: int = 32768

    def __attrs_post_init__(self) -> None:
        if bool(self.command) == bool(self.function):
            raise ValueError(
                'give the agent as command = ["{python}", "agent.py"] or as '
                'function = "module:name", one of the two'
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@attrs.frozen
class AgentEpisode:
    """What an in-process agent function is given: the task and where its model is."""

    prompt: str
    system: str
    messages: list[dict[str, Any]]
    """The task's opening messages in the Hugging Face chat shape."""
    openai_base_url: str
    anthropic_base_url: str
    api_key: str
    model: str


class HarnessEnvironment:
    """Tasks of another environment, played by an agent program through the proxy."""

    def __init__(self, options: HarnessOptions) -> None:
        self.options = options
        self.tasks: Environment = build(
            "env",
            options.tasks,
            options=options.task_options,
            options_path="env.options.task_options",
        )
        self.name = f"proxy.harness({self.tasks.name})"
        self.proxy = EpisodeProxy(options.model_name, options.max_context_tokens)
        self.store = self.proxy.store

    async def splits(self) -> list[Split]:
        return await self.tasks.splits()

    async def num_tasks(self, split: str) -> int:
        return await self.tasks.num_tasks(split)

    async def get_task(self, split: str, index: int) -> dict[str, Any]:
        return await self.tasks.get_task(split, index)

    async def open(
        self, task: Mapping[str, Any], secrets: Mapping[str, str] | None = None
    ) -> EnvSession:
        return await self.tasks.open(task, secrets)

    async def close(self) -> None:
        await self.proxy.close()
        await self.tasks.close()

    async def run_episode(
        self,
        task: Mapping[str, Any],
        engine: InferenceEngine,
        renderer: Renderer,
        config: EpisodeConfig,
    ) -> Trajectory:
        url = await self.proxy.url(engine, renderer)
        outcome: dict[str, Any] = {
            "rewards": [],
            "correct": False,
            "finished": False,
            "truncated": False,
        }
        turns: list[Any] = []
        error: str | None = None
        try:
            async with self._episode(task, config) as (session_id, env_session):
                messages = await asyncio.wait_for(env_session.messages(), config.env_timeout_s)
                answer, failure, timed_out = await self._run_agent(
                    self._agent_episode(url, session_id, messages)
                )
                turns = self.store.sessions[session_id].turns()
                outcome["truncated"] = timed_out or self.store.sessions[session_id].policy_exhausted
                if failure is not None and not turns:
                    error = failure
                else:
                    await self._score(env_session, answer, config, outcome)
        except EngineError:  # plait's own part failed, not the episode's
            raise
        except Exception as exc:  # the task environment failed: this episode only
            error = f"{type(exc).__name__}: {exc}"
            log.warning("harness episode failed", error=error)
        return Trajectory(
            task=dict(task),
            turns=turns,
            rewards=outcome["rewards"],
            reward=reduce_rewards(outcome["rewards"], config.reward_reduce),
            correct=outcome["correct"],
            finished=outcome["finished"],
            truncated=outcome["truncated"],
            error=error,
        )

    @contextlib.asynccontextmanager
    async def _episode(
        self, task: Mapping[str, Any], config: EpisodeConfig
    ) -> AsyncIterator[tuple[str, EnvSession]]:
        env_session: EnvSession | None = None
        try:
            async with self.proxy.session(config) as session:
                env_session = await asyncio.wait_for(self.tasks.open(task), config.env_timeout_s)
                yield session.id, env_session
        finally:
            if env_session is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(env_session.close(), config.env_timeout_s)

    def _agent_episode(self, url: str, session_id: str, messages: list[Message]) -> AgentEpisode:
        return AgentEpisode(
            prompt="\n\n".join(m.content for m in messages if m.role == "user"),
            system="\n\n".join(m.content for m in messages if m.role == "system"),
            messages=[{"role": m.role, "content": m.content} for m in messages],
            openai_base_url=f"{url}/s/{session_id}/v1",
            anthropic_base_url=f"{url}/s/{session_id}",
            api_key=session_id,
            model=self.options.model_name,
        )

    async def _run_agent(self, episode: AgentEpisode) -> tuple[str, str | None, bool]:
        """(the answer, why the agent failed or None, whether it timed out)."""
        if self.options.function is None:
            return await self._run_command(episode)
        function = load_target(self.options.function)
        try:
            async with asyncio.timeout(self.options.timeout_s):
                if inspect.iscoroutinefunction(function):
                    answer = await function(episode)
                else:
                    answer = await asyncio.to_thread(function, episode)
        except TimeoutError:
            return "", f"the agent ran past timeout_s={self.options.timeout_s}", True
        except Exception as exc:  # the agent's own failure (often the model's output it choked on)
            failure = f"the agent raised {type(exc).__name__}: {exc}"
            log.warning("agent failed", error=failure)
            return "", failure, False
        return str(answer if answer is not None else "").strip(), None, False

    async def _run_command(self, episode: AgentEpisode) -> tuple[str, str | None, bool]:
        env = {
            **os.environ,
            **self.options.env,
            "OPENAI_BASE_URL": episode.openai_base_url,
            "OPENAI_API_KEY": episode.api_key,
            "ANTHROPIC_BASE_URL": episode.anthropic_base_url,
            "ANTHROPIC_API_KEY": episode.api_key,
            "PLAIT_PROMPT": episode.prompt,
            "PLAIT_SYSTEM": episode.system,
            "PLAIT_MODEL": episode.model,
            "PLAIT_MESSAGES": json.dumps(episode.messages),
        }
        argv = [sys.executable if part == "{python}" else part for part in self.options.command]
        process = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), self.options.timeout_s)
        except TimeoutError:
            process.kill()
            stdout, stderr = await process.communicate()
            return (
                _last_line(stdout),
                f"the agent program ran past timeout_s={self.options.timeout_s}",
                True,
            )
        except asyncio.CancelledError:
            process.kill()
            raise
        if process.returncode != 0:
            tail = stderr.decode(errors="replace").strip().splitlines()[-5:]
            failure = f"the agent program exited with {process.returncode}: {' | '.join(tail)}"
            log.warning("agent program failed", error=failure)
            return _last_line(stdout), failure, False
        return _last_line(stdout), None, False

    async def _score(
        self, env_session: EnvSession, answer: str, config: EpisodeConfig, outcome: dict[str, Any]
    ) -> None:
        terminal = await asyncio.wait_for(env_session.terminal_tool(), config.env_timeout_s)
        if terminal is None:
            raise ValueError(f"{self.tasks.name} has no terminal tool to score a plain answer with")
        output = await asyncio.wait_for(
            env_session.call(terminal.name, {terminal_argument(terminal): answer}),
            config.env_timeout_s,
        )
        if isinstance(output, ToolError):
            raise RuntimeError(f"scoring the answer failed: {output.error}")
        assert isinstance(output, ToolOutput)
        if output.reward is not None:
            outcome["rewards"].append(float(output.reward))
        outcome["correct"] = is_correct(output)
        outcome["finished"] = True


def _last_line(stdout: bytes) -> str:
    lines = [line.strip() for line in stdout.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def make_harness_env(*, options: HarnessOptions) -> HarnessEnvironment:
    return HarnessEnvironment(options)
