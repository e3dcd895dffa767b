"""The program the `verifiers` environment runs in the verifiers venv: it loads one verifiers
environment and runs its rollouts, its own code as written, against the endpoints it is given.

It imports only the standard library and verifiers (it runs with the venv's interpreter, by path,
where plait is not installed). Usage: `python -P verifiers_driver.py ENVIRONMENT ARGS_JSON` (-P:
the `verifiers.py` beside it must not shadow the package). It loads
the environment the way `vf-eval` does (`verifiers.load_environment(env_id, **args)`), then speaks
JSON lines: the first line it writes is `{"splits": {"train": n, "test": m}}` (or `{"fatal": why}`
and exit status 1); after that each request read from stdin, `{"id", "op": "task", "split",
"index"}` or `{"id", "op": "run", "split", "index", "base_url", "api_key", "model"}`, is answered
by a line with the same id, requests running concurrently. A run is `Environment.run_rollout`
(the rollout, then `Rubric.score_rollout`, as `vf-eval` with independent scoring) with an
`AsyncOpenAI` client at `base_url`, and answers the rubric's reward and per-function metrics,
whether verifiers marked it truncated, and the rollout's error, if any.

Splits: train is the environment's `dataset`, test its `eval_dataset`, falling back to `dataset`
as `Environment.get_eval_dataset` does. Protocol lines go to the real stdout; anything the
environment prints goes to stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import sys
from typing import Any


def _splits(env: Any) -> dict[str, Any]:
    splits = {}
    if env.build_dataset() is not None:
        splits["train"] = env.get_dataset()
    splits["test"] = env.get_eval_dataset()  # verifiers' own fallback to the train dataset
    return splits


def _plain(value: Any) -> Any:
    """`value` as JSON can carry it (Pydantic messages as dicts, anything else as text)."""
    return json.loads(
        json.dumps(value, default=lambda v: getattr(v, "model_dump", lambda: str(v))())
    )


def _task(row: dict[str, Any]) -> dict[str, Any]:
    return {
        key: _plain(row[key]) for key in ("example_id", "prompt", "answer", "info") if key in row
    }


async def _run(env: Any, rows: Any, request: dict[str, Any]) -> dict[str, Any]:
    import verifiers as vf  # type: ignore[import-not-found]  # only in its own venv
    from openai import AsyncOpenAI

    # no retries: a refused call (the episode's budget of calls is spent) must end the rollout
    client = AsyncOpenAI(base_url=request["base_url"], api_key=request["api_key"], max_retries=0)
    try:
        output = await env.run_rollout(
            dict(rows[request["index"]]),
            vf.OpenAIChatCompletionsClient(client),
            request["model"],
            dict(env.sampling_args),  # what `Environment.generate` sends when given none
        )
    finally:
        await client.close()
    reward = output.get("reward")
    metrics = output.get("metrics") or {}
    error = output.get("error")
    numbers = [reward, *metrics.values()]
    if not all(isinstance(n, (int, float)) and math.isfinite(n) for n in numbers):
        return {"error": f"the rubric gave a reward that is not a number: {reward!r}, {metrics!r}"}
    return {
        "reward": float(reward),
        "metrics": {name: float(value) for name, value in metrics.items()},
        "truncated": bool(output.get("is_truncated")),
        "stop_condition": output.get("stop_condition"),
        "rollout_error": None if error is None else f"{type(error).__name__}: {error}",
        "pass_threshold": float(env.pass_threshold),
    }


async def _answer(env: Any, splits: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    try:
        rows = splits[request["split"]]
        if request["op"] == "task":
            return {"task": _task(rows[request["index"]])}
        return await _run(env, rows, request)
    except Exception as exc:  # the environment's code failed: this request only
        return {"error": f"{type(exc).__name__}: {exc}"}


async def _serve(env: Any, splits: dict[str, Any], out: Any) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running: set[asyncio.Task[None]] = set()

    async def one(request: dict[str, Any]) -> None:
        answer = await _answer(env, splits, request)
        out.write(json.dumps({"id": request["id"], **answer}) + "\n")
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
    environment, args = argv[1], json.loads(argv[2])
    try:
        import verifiers as vf

        env = vf.load_environment(environment, **args)
        splits = _splits(env)
    except Exception as exc:
        out.write(json.dumps({"fatal": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"splits": {name: len(rows) for name, rows in splits.items()}}) + "\n")
    out.flush()
    asyncio.run(_serve(env, splits, out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
