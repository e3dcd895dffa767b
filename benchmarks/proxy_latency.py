"""What the proxy adds to a request: the same one-token completion asked of the engine directly
(`engine.sample` on prompt ids rendered beforehand) and through plait-proxy over loopback HTTP
(Chat Completions: parse, render, sample, parse the answer, record it, write JSON), interleaved
request by request so that the machine's noise hits every path alike. The proxy path is timed with
a minimal keep-alive HTTP client (ors_server.RawConnection, costing the client little), so that
the difference is the proxy's; httpx's and the openai SDK's round trips are measured too (their
own client costs included), for what a harness sees. Client and server share one event loop, as
in-process harness agents do. Writes benchmarks/results/proxy_latency.json.

    python benchmarks/proxy_latency.py [--requests 300]

Needs plait-torch, plait-qwen and plait-proxy (and openai for the SDK column).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from ors_server import RawConnection  # benchmarks/ is the script's directory

from plait.plugins import get_registry
from plait.types import Message, SamplingParams
from plait_proxy.app import ProxyApp, ServeOptions
from plait_proxy.proxy import Proxy
from plait_proxy.store import RolloutStore
from plait_testing.models import materialize_model

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 7*6? Answer with a number."},
]
RESULTS = Path(__file__).parent / "results" / "proxy_latency.json"


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": statistics.median(ordered) * 1e3,
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
        "mean_ms": statistics.fmean(ordered) * 1e3,
    }


async def measure(requests: int) -> dict[str, Any]:
    import logging

    import openai

    logging.getLogger("httpx2").setLevel(logging.WARNING)

    registry = get_registry()
    model = materialize_model("tiny-qwen3", Path(tempfile.mkdtemp()) / "tiny-qwen3")
    engine = registry.get("inference_engine", "torch").load()(model, options=None, seed=0)
    renderer = registry.get("renderer", "qwen3_keep_reasoning").load()(model, options=None)
    store = RolloutStore()
    app = ProxyApp(Proxy(engine, renderer, "tiny-qwen3"), store, ServeOptions(port=0))
    prompt = renderer.build_generation_prompt([Message(m["role"], m["content"]) for m in MESSAGES])
    params = SamplingParams(max_tokens=1, temperature=0.0)
    body = {"model": "tiny-qwen3", "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    times: dict[str, list[float]] = {
        "engine": [],
        "proxy": [],
        "proxy_httpx": [],
        "proxy_openai_sdk": [],
    }
    async with (
        app.serving() as url,
        httpx.AsyncClient(base_url=url) as http,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench") as sdk,
    ):
        host, port = url.removeprefix("http://").split(":")
        raw = RawConnection(host, int(port))

        async def direct() -> None:
            await engine.sample(prompt, 1, params)

        async def via_raw() -> None:
            await raw.request("POST", "/s/bench-raw/v1/chat/completions", body=body)

        async def via_http() -> None:
            response = await http.post(
                "/v1/chat/completions", json=body, headers={"x-plait-session": "bench-http"}
            )
            response.raise_for_status()

        async def via_sdk() -> None:
            await sdk.chat.completions.create(
                model="tiny-qwen3",
                messages=MESSAGES,
                max_tokens=1,
                temperature=0,  # type: ignore[arg-type]
                extra_headers={"x-plait-session": "bench-sdk"},
            )

        paths = {
            "engine": direct,
            "proxy": via_raw,
            "proxy_httpx": via_http,
            "proxy_openai_sdk": via_sdk,
        }
        for _ in range(10):  # warm up every path
            for run in paths.values():
                await run()
        for i in range(requests):
            order = list(paths.items())
            order = (
                order[i % len(order) :] + order[: i % len(order)]
            )  # no path always runs right after another
            for name, run in order:
                start = time.perf_counter()
                await run()
                times[name].append(time.perf_counter() - start)
            for session in list(store.sessions):
                store.finish(session)  # keep the store as small as a live proxy's
        raw.close()
    await engine.close()
    stats = {name: percentiles(samples) for name, samples in times.items()}
    return {
        "benchmark": "proxy_latency",
        "requests": requests,
        "model": "tiny-qwen3 (plait-torch, CPU)",
        "completion_tokens": 1,
        "machine": platform.platform(),
        "results": stats,
        "added_p50_ms": stats["proxy"]["p50_ms"] - stats["engine"]["p50_ms"],
        "added_p50_ms_with_httpx": stats["proxy_httpx"]["p50_ms"] - stats["engine"]["p50_ms"],
        "added_p50_ms_with_openai_sdk": stats["proxy_openai_sdk"]["p50_ms"]
        - stats["engine"]["p50_ms"],
        "goal_added_p50_ms": 5.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    result = asyncio.run(measure(args.requests))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
