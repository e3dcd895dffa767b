"""The program the `verifiers` environment runs in the verifiers 0.4.0 venv (`api = "v1"`): it
loads one `verifiers.v1` taskset and runs its rollouts, its own code as written, against the
endpoints it is given.

It imports only the standard library and verifiers (it runs with the venv's interpreter, by path,
where plait is not installed). Usage: `python -P verifiers_v1_driver.py TASKSET ARGS_JSON`. It
speaks the JSON-line protocol of `verifiers_driver.py` (first line `{"splits": ...}` or
`{"fatal": why}`; then `task` and `run` requests answered concurrently, by id).

The environment is built the way `vf-eval TASKSET` builds it (`resolve_env_config`, then
`load_environment`: the taskset's own `Env`, else `SingleAgentEnv`) with ARGS as the taskset's
config (`--env.taskset.*`), the agent's runtime `subprocess` and its harness `null` (the chat
program, run by `uv`; `--env.agent.runtime.type subprocess --env.agent.harness.id null`). Its
serving resources (the interception server, shared tool servers) come up once, as in `vf-eval`'s
in-process runner, and each run is one episode, `Env.run_slot`, with the model client at the
session's `base_url`: verifiers' interception proxy forwards the harness's (streaming) chat
requests there. The path names plait's session, so the API key is not needed.

Splits: a taskset is one list of tasks (`load()`), so `train` and `test` are both that list.
A run answers the trace's reward (the weighted sum of its `@vf.reward`s), each reward's score and
each `@vf.metric` by name, whether verifiers marked it truncated, and the error that ended it, if
any. verifiers scores a failed run not at all; such a run (the proxy refusing a call past the
run's `max_turns`, say) is scored here on what it has, with `Task.score(trace)` as verifiers'
own offline scoring does (signals that need the runtime are left out). v1 has no pass threshold
of its own; `pass_threshold` is 1.0, what its `best-of-n` env counts as solved.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import sys
from typing import Any

PASS_THRESHOLD = 1.0


def _env_config(taskset: str, args: dict[str, Any]) -> Any:
    from verifiers.v1.utils.loaders import resolve_env_config  # type: ignore[import-not-found]

    return resolve_env_config(
        {
            "taskset": {**args, "id": taskset},
            "agent": {"runtime": {"type": "subprocess"}, "harness": {"id": "null"}},
        }
    )


def _task(task: Any) -> dict[str, Any]:
    fields: dict[str, Any] = task.data.model_dump(mode="json", exclude_defaults=True)
    return fields


def _error(trace: Any, episode: Any) -> str | None:
    last = trace.last_error or episode.last_error
    if trace.ok and episode.ok:
        return None
    if last is None:
        return f"the rollout stopped: {trace.stop_condition}"
    return f"{last.type}: {last.message}"


async def _run(env: Any, tasks: list[Any], request: dict[str, Any]) -> dict[str, Any]:
    import verifiers.v1 as vf  # type: ignore[import-not-found]  # only in its own venv

    task = tasks[request["index"]]
    context = vf.ModelContext(
        model=request["model"],
        client=vf.EvalClientConfig(base_url=request["base_url"], api_key_var="PLAIT_NO_API_KEY"),
    )
    [slot] = env.slots(task, 1)
    episode = await env.run_slot(slot, context)
    if len(episode.traces) != 1:
        error = episode.last_error
        why = "" if error is None else f": {error.type}: {error.message}"
        return {"error": f"the episode ran {len(episode.traces)} agent runs, not one{why}"}
    [trace] = episode.traces
    rollout_error = _error(trace, episode)
    if rollout_error is not None and all(r is None for r in trace.rewards.values()):
        await task.score(trace)  # verifiers skipped scoring the failed run
    metrics: dict[str, Any] = {
        name: None if r is None else r.score for name, r in trace.rewards.items()
    }
    metrics.update(trace.metrics)
    numbers = [trace.reward, *metrics.values()]
    if not all(isinstance(n, (int, float)) and math.isfinite(n) for n in numbers):
        return {"error": f"the task gave a reward that is not a number: {metrics!r}"}
    return {
        "reward": float(trace.reward),
        "metrics": {name: float(value) for name, value in metrics.items()},
        "truncated": bool(trace.is_truncated),
        "stop_condition": trace.stop_condition,
        "rollout_error": rollout_error,
        "pass_threshold": PASS_THRESHOLD,
    }


async def _answer(env: Any, tasks: list[Any], request: dict[str, Any]) -> dict[str, Any]:
    try:
        if request["split"] not in ("train", "test"):
            raise KeyError(request["split"])
        if request["op"] == "task":
            return {"task": _task(tasks[request["index"]])}
        return await _run(env, tasks, request)
    except Exception as exc:  # the environment's code failed: this request only
        return {"error": f"{type(exc).__name__}: {exc}"}


async def _serve(env: Any, tasks: list[Any], out: Any) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running: set[asyncio.Task[None]] = set()

    async def one(request: dict[str, Any]) -> None:
        answer = await _answer(env, tasks, request)
        out.write(json.dumps({"id": request["id"], **answer}) + "\n")
        out.flush()

    async with env.serving():  # the interception server and shared tools, as vf-eval's
        out.write(json.dumps({"splits": {"train": len(tasks), "test": len(tasks)}}) + "\n")
        out.flush()
        while line := await reader.readline():
            task = asyncio.create_task(one(json.loads(line)))
            running.add(task)
            task.add_done_callback(running.discard)
        if running:  # stdin closed: plait is done with this environment
            await asyncio.wait(running)


def main(argv: list[str]) -> int:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the environment prints must not mix with the protocol
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # the null harness's chat program runs with `uv`, installed in this venv
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    taskset, args = argv[1], json.loads(argv[2])
    try:
        from verifiers.v1.utils.loaders import load_environment

        env = load_environment(_env_config(taskset, args))
        if not env.taskset.bounded:
            raise ValueError(f"the taskset {taskset!r} is infinite")
        tasks = list(env.taskset)
    except Exception as exc:
        out.write(json.dumps({"fatal": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return 1
    try:
        asyncio.run(_serve(env, tasks, out))
    except Exception as exc:  # serving could not start (before the splits line)
        out.write(json.dumps({"fatal": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
