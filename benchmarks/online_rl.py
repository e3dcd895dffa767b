"""Online RL under load: simulated users against `plait serve online`.

The server (`examples/online_arith_tiny.toml`: tiny-qwen3-arith, plait-torch engines) runs in a
process of its own. `--users` concurrent users send math.arith training tasks through the OpenAI
Chat Completions API, judge each answer with the environment's own verifier and post the reward
to /v1/feedback: at once, `--late` of them 2-20 s late, `--missing` of them never. At
`--regress-at` of the run the learning rate is set to `--destructive-lr` (POST
/v1/online/settings) until the gate has rejected a version, then set back: the served version
must not change meanwhile.

Reported (benchmarks/results/online_rl.json, plotted in online_rl.png beside it): the reward of
served answers per tenth of the run, failed requests, p50/p99 latency of requests overlapping a
weight update of the serving engine and of the others, the gate's decisions, and the server's
final status.

    python benchmarks/online_rl.py [--minutes 10] [--users 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from plait.plugins import build
from plait_proxy.simulated_users import (
    Load,
    env_user_tasks,
    inject_regression,
    online_process,
    simulate_users,
    summarize,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "online_arith_tiny.toml"


async def drive(url: str, load: Load, regress_at: float, destructive_lr: float) -> dict[str, Any]:
    env = build("env", "math.arith", options={"preset": "tiny"})
    tasks = await env_user_tasks(env, "train", 2000)
    regression: dict[str, Any] = {}
    requests = await simulate_users(
        url,
        tasks,
        load,
        during=lambda client: inject_regression(
            client,
            after_s=regress_at * load.seconds,
            destructive_lr=destructive_lr,
            report=regression,
        ),
    )
    status = httpx.get(f"{url}/v1/online/status", headers={"authorization": "Bearer online"}).json()
    await env.close()
    return {
        "summary": summarize(requests, status["events"]),
        "regression": regression,
        "status": {k: v for k, v in status.items() if k != "events"},
        "events": status["events"],
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """Served reward per window, the gate's score of every candidate (promoted or not) and the
    destructive update, on one time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, events = result["summary"], result["events"]
    t0 = summary["start"]
    width = summary["window_s"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    windows = [
        (i * width + width / 2, r)
        for i, r in enumerate(summary["reward_by_window"])
        if r is not None
    ]
    ax.plot(*zip(*windows, strict=True), "o-", color="black", label="reward of served answers")
    for promoted, color, label in (
        (True, "tab:green", "candidate served"),
        (False, "tab:red", "candidate rejected"),
    ):
        points = [
            (e["time"] - t0, e["score"])
            for e in events
            if "score" in e and e["promoted"] is promoted
        ]
        if points:
            ax.scatter(*zip(*points, strict=True), s=12, color=color, label=f"gate score: {label}")
    if result["regression"].get("at"):
        ax.axvline(
            result["regression"]["at"] - t0,
            color="tab:red",
            linestyle=":",
            label="destructive learning rate set",
        )
    ax.set(
        xlabel="seconds",
        ylabel="reward / gate score",
        ylim=(-0.02, 1.02),
        title=f"plait serve online: {result['users']} simulated users, "
        f"{summary['failed']} failed of {summary['requests']} requests",
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--late", type=float, default=0.2)
    parser.add_argument("--missing", type=float, default=0.1)
    parser.add_argument("--regress-at", type=float, default=0.6, help="fraction of the run")
    parser.add_argument("--destructive-lr", type=float, default=0.5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "online_rl.json"))
    parser.add_argument(
        "-s", "--set", dest="overrides", action="append", default=[], help="config override"
    )
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    load = Load(
        users=args.users,
        seconds=args.minutes * 60,
        feedback_late=args.late,
        feedback_missing=args.missing,
    )
    with tempfile.TemporaryDirectory() as out_dir:
        server_log = Path(out_dir) / "server.log"
        with online_process(
            args.config, server_log, f"run.out_dir={out_dir}", *args.overrides, fresh=True
        ) as (url, _):
            started = time.time()
            result = asyncio.run(drive(url, load, args.regress_at, args.destructive_lr))
            result["seconds"] = time.time() - started
    result.update(
        config=args.config,
        users=args.users,
        minutes=args.minutes,
        late=args.late,
        missing=args.missing,
        machine={
            "cpus": platform.processor() or platform.machine(),
            "python": sys.version.split()[0],
        },
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    plot(result, Path(args.out).with_suffix(".png"))
    s = result["summary"]
    print(
        json.dumps(
            {
                k: s[k]
                for k in (
                    "requests",
                    "failed",
                    "errors",
                    "reward_by_window",
                    "latency_during_updates_s",
                    "latency_between_updates_s",
                    "updates",
                    "promotions",
                    "rollbacks",
                )
            },
            indent=1,
        )
    )
    print("regression:", json.dumps(result["regression"]))
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")


if __name__ == "__main__":
    main()
