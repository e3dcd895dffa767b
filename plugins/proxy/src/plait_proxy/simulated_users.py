"""A bounded load generator for `plait serve online`: concurrent simulated users, each sending a
task, judging the answer and posting its reward to /v1/feedback — at once, late, or never —
until the time is up. What every request did is returned for `summarize`, which reports the
reward of served answers over time, failed requests, and latency while the serving engines took
a new version against between updates. The online benchmark and test drive a server with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import numpy as np

from plait.api import Environment
from plait_proxy.online import judge_answer


@attrs.frozen
class UserTask:
    messages: tuple[Mapping[str, Any], ...]
    """The chat messages a user sends."""
    judge: Callable[[str], Awaitable[float]]
    """The reward of an answer's text."""


async def env_user_tasks(env: Environment, split: str, count: int) -> list[UserTask]:
    """The first `count` tasks of an environment's split as users' requests, each answer judged
    by the environment itself: its terminal tool (`final_answer` of the math environments)
    called with the answer's text in a session of its own."""
    tasks = []
    for index in range(min(count, await env.num_tasks(split))):
        task = await env.get_task(split, index)
        session = await env.open(task)
        try:
            messages = tuple(
                {"role": m.role, "content": m.content} for m in await session.messages()
            )
        finally:
            await session.close()
        tasks.append(UserTask(messages, functools.partial(judge_answer, env, task)))
    return tasks


@attrs.frozen(kw_only=True)
class Load:
    users: int = 8
    seconds: float = 60.0
    feedback_missing: float = 0.1
    """Fraction of answers whose reward is never sent."""
    feedback_late: float = 0.2
    """Fraction whose reward is sent `late_s` seconds after the answer."""
    late_s: tuple[float, float] = (2.0, 20.0)
    temperature: float = 1.0
    max_tokens: int = 16
    seed: int = 0


@attrs.define
class Request:
    """One request of one user, as it went."""

    start: float
    end: float
    ok: bool
    error: str | None = None
    response_id: str | None = None
    version: int | None = None
    reward: float | None = None
    feedback: str = "none"
    """"now", "late", "missing", or "none" (the request failed); "acknowledged" once the server
    took it, "refused: ..." if it did not."""


async def simulate_users(
    base_url: str,
    tasks: Sequence[UserTask],
    load: Load,
    *,
    api_key: str = "online",
    during: Callable[[httpx.AsyncClient], Coroutine[Any, Any, None]] | None = None,
    until: Callable[[Sequence[Request]], bool] | None = None,
) -> list[Request]:
    """Run `load.users` users for `load.seconds` against the server at `base_url`, or until
    `until(the requests so far)` holds; late rewards still due then are sent before returning.
    `during(client)` runs beside them (e.g. to change the server's settings mid-run)."""
    requests: list[Request] = []
    late: list[asyncio.Task[None]] = []
    deadline = time.monotonic() + load.seconds
    limits = httpx.Limits(max_connections=load.users * 2 + 4)
    async with httpx.AsyncClient(
        base_url=base_url,
        timeout=120.0,
        limits=limits,
        headers={"authorization": f"Bearer {api_key}"},
    ) as client:
        # users ask for the model the server serves, as a client that lists the models does
        model = (await client.get("/v1/models")).raise_for_status().json()["data"][0]["id"]

        async def feedback(request: Request, delay: float) -> None:
            await asyncio.sleep(delay)
            try:
                reply = await client.post(
                    "/v1/feedback",
                    json={"response_id": request.response_id, "reward": request.reward},
                )
                request.feedback = (
                    "acknowledged" if reply.status_code == 200 else f"refused: {reply.text}"
                )
            except httpx.HTTPError as exc:
                request.feedback = f"refused: {type(exc).__name__}: {exc}"

        async def user(index: int) -> None:
            rng = random.Random(load.seed * 1000 + index)
            while time.monotonic() < deadline and not (until is not None and until(requests)):
                task = tasks[rng.randrange(len(tasks))]
                request = Request(time.time(), 0.0, False)
                requests.append(request)
                try:
                    reply = await client.post(
                        "/v1/chat/completions",
                        json={
                            "model": model,
                            "messages": list(task.messages),
                            "temperature": load.temperature,
                            "max_tokens": load.max_tokens,
                        },
                    )
                    request.end = time.time()
                    if reply.status_code != 200:
                        request.error = f"HTTP {reply.status_code}: {reply.text[:300]}"
                    else:
                        body = reply.json()
                except httpx.HTTPError as exc:
                    request.end, request.error = time.time(), f"{type(exc).__name__}: {exc}"
                if request.error is not None:
                    await asyncio.sleep(0.2)  # a user waits a little before trying again
                    continue
                request.ok, request.response_id = True, body["id"]
                request.version = body["plait"]["weight_version"]
                request.reward = await task.judge(body["choices"][0]["message"]["content"] or "")
                draw = rng.random()
                if draw < load.feedback_missing:
                    request.feedback = "missing"
                elif draw < load.feedback_missing + load.feedback_late:
                    request.feedback = "late"
                    late.append(asyncio.create_task(feedback(request, rng.uniform(*load.late_s))))
                else:
                    request.feedback = "now"
                    await feedback(request, 0.0)

        side = asyncio.create_task(during(client)) if during is not None else None
        await asyncio.gather(*(user(i) for i in range(load.users)))
        await asyncio.gather(*late)
        if side is not None:
            await side
    return requests


async def inject_regression(
    client: httpx.AsyncClient,
    *,
    after_s: float,
    destructive_lr: float,
    report: dict[str, Any],
    min_score: float = 0.3,
    timeout_s: float = 300.0,
) -> None:
    """Set a destructive learning rate after `after_s` (and once the serving version's held-out
    accuracy has reached `min_score`, so that there is something to lose), wait until the gate
    has judged a version trained at it, set the learning rate back. `report` says what happened:
    the gate's verdict on that version (`caught`: rejected and rolled back; its event says which
    version served after it)."""
    await asyncio.sleep(after_s)
    deadline = time.monotonic() + timeout_s
    before = (await client.get("/v1/online/status")).json()
    while before["serving_score"] < min_score and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        before = (await client.get("/v1/online/status")).json()
    await client.post("/v1/online/settings", json={"learning_rate": destructive_lr})
    report.update(
        at=time.time(),
        serving_version_before=before["serving_version"],
        serving_score_before=before["serving_score"],
        destructive_lr=destructive_lr,
    )
    destructive: list[dict[str, Any]] = []
    status = before
    while not destructive and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        status = (await client.get("/v1/online/status")).json()
        destructive = [
            e for e in status["events"] if e.get("learning_rate") == destructive_lr and "score" in e
        ]
    await client.post("/v1/online/settings", json={"learning_rate": before["learning_rate"]})
    report.update(
        restored_at=time.time(),
        gated=destructive[:1],
        caught=bool(destructive)
        and not destructive[0]["promoted"]
        and destructive[0]["rolled_back"],
    )


def summarize(
    requests: Sequence[Request], events: Sequence[Mapping[str, Any]], *, windows: int = 10
) -> dict[str, Any]:
    """Served reward per time window, failures, and latency during weight updates (a request
    whose interval overlaps a push to the serving engines) and between them."""
    done = [r for r in requests if r.ok]
    start = min((r.start for r in requests), default=0.0)
    span = max((r.end for r in requests), default=start) - start
    width = span / windows if span > 0 else 1.0
    reward_by_window = []
    for w in range(windows):
        inside = [
            r.reward
            for r in done
            if r.reward is not None and start + w * width <= r.start < start + (w + 1) * width
        ]
        reward_by_window.append(float(np.mean(inside)) if inside else None)
    pushes = [(e["push_start"], e["push_end"]) for e in events if "push_start" in e]
    during = [r.end - r.start for r in done if any(r.start < b and r.end > a for a, b in pushes)]
    between = [
        r.end - r.start for r in done if not any(r.start < b and r.end > a for a, b in pushes)
    ]
    return {
        "requests": len(requests),
        "failed": len(requests) - len(done),
        "errors": sorted({r.error for r in requests if r.error})[:5],
        "feedback": {
            kind: sum(r.feedback == kind for r in requests) for kind in ("acknowledged", "missing")
        },
        "feedback_refused": sum(r.feedback.startswith("refused") for r in requests),
        "reward_by_window": reward_by_window,
        "window_s": width,
        "start": start,
        "latency_during_updates_s": _percentiles(during),
        "latency_between_updates_s": _percentiles(between),
        "updates": len(events),
        "promotions": sum(bool(e.get("promoted")) for e in events),
        "rejections": sum(e.get("promoted") is False and "score" in e for e in events),
        "rollbacks": sum(bool(e.get("rolled_back")) for e in events),
        "versions_served": sorted({r.version for r in done if r.version is not None}),
    }


def _percentiles(values: Sequence[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "p50": None, "p99": None}
    return {
        "count": len(values),
        "p50": float(np.percentile(values, 50)),
        "p99": float(np.percentile(values, 99)),
    }


@contextlib.contextmanager
def online_process(
    config: str | Path,
    log_path: Path,
    *overrides: str,
    port: int = 0,
    fresh: bool = False,
    ready_s: float = 600.0,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`plait serve online CONFIG` in a process of its own, once it answers /health (killed at
    the end of the block if still running); yields its base URL and the process."""
    from plait_server.engine import free_port

    port = port or free_port()
    argv = [
        sys.executable,
        "-m",
        "plait.cli",
        "serve",
        "online",
        str(config),
        "--port",
        str(port),
        *(["--fresh"] if fresh else []),
        *(a for o in overrides for a in ("-s", o)),
    ]
    url = f"http://127.0.0.1:{port}"
    with log_path.open("ab") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + ready_s
            while True:
                if server.poll() is not None:
                    raise RuntimeError(
                        f"plait serve online exited ({server.returncode}): "
                        f"{log_path.read_text()[-3000:]}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"plait serve online did not answer within {ready_s:g} s")
                time.sleep(0.5)
            yield url, server
        finally:
            if server.poll() is None:
                server.terminate()
                try:
                    server.wait(30)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
