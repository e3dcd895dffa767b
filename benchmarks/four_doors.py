"""One task, four doors, each learned through: examples/reasoning_gym_smollm2.toml (GRPO on
SmolLM2-135M-Instruct, reasoning-gym's one-digit sums with three worked examples) run as it is
(plait's own `reasoning_gym` environment), over ORS (the same environment behind `plait env
serve`, `env.name = "ors"`), over OpenEnv (behind `plait env serve --protocol openenv`,
`env.name = "openenv"`) and through verifiers (examples/verifiers/vf_reasoning_gym, a verifiers
`SingleTurnEnv` and `Rubric` over the same reasoning-gym items, `env.name = "verifiers"`).
tests/test_four_doors.py shows that the doors score a completion alike; this shows that each
door's run raises held-out accuracy. Writes benchmarks/results/four_doors.json (one row per
door and seed, resumable) and prints each door's first and last held-out accuracy.

    python benchmarks/four_doors.py [--doors plait ors openenv verifiers] [--seeds 0]

Needs plait-torch, plait-math, plait-sdk, plait-proxy and the verifiers venv
(scripts/ci/verifiers.sh).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tomlkit
from learning_curves import ROOT, run_curve

CONFIG = ROOT / "examples" / "reasoning_gym_smollm2.toml"
RESULTS = ROOT / "benchmarks" / "results"
DOORS = ("plait", "ors", "openenv", "verifiers")


def task_options() -> dict[str, Any]:
    options: dict[str, Any] = tomllib.loads(CONFIG.read_text())["env"]["options"]
    return options


def serve(protocol: str, port: int) -> None:
    """This script's serving mode: the example's environment on 127.0.0.1:port."""
    from plait.api import build

    env = build("env", "reasoning_gym", options=task_options())
    if protocol == "openenv":
        from plait_sdk.openenv_server import OpenEnvServer

        OpenEnvServer(env).run("127.0.0.1", port)
    else:
        from plait_sdk.server import Server

        Server([env]).run("127.0.0.1", port)


def serve_command(protocol: str, port: int | str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--serve", protocol, str(port)]


@contextlib.contextmanager
def ors_server() -> Iterator[str]:
    """The example's environment served over ORS in a subprocess, for the run's duration."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(serve_command("ors", port), cwd=ROOT)
    try:
        deadline = time.time() + 120
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if process.poll() is not None or time.time() > deadline:
                raise RuntimeError("the ORS server did not start")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(30)


def door_options(door: str, ors_url: str | None) -> tuple[str, dict[str, Any]]:
    """The environment name and options that reach the example's task through `door`."""
    options = task_options()
    if door == "plait":
        return "reasoning_gym", options
    if door == "ors":
        return "ors", {"url": ors_url}
    if door == "openenv":
        sizes = {"train": options["train_size"], "test": options["test_size"]}
        return "openenv", {
            "command": serve_command("openenv", "{port}"),
            "splits": {split: list(range(n)) for split, n in sizes.items()},
            "split_reset": {"test": {"split": "test"}},
            "messages_field": "messages",
        }
    return "verifiers", {
        "environment": "vf-reasoning-gym",
        "args": {
            "datasets": options["datasets"],
            "seed": options["seed"],
            "num_train_examples": options["train_size"],
            "num_eval_examples": options["test_size"],
            "system_prompt": options["system_prompt"],
            "few_shot": options["few_shot"],
        },
    }


def run_door(door: str, seed: int) -> dict[str, Any]:
    config = tomllib.loads(CONFIG.read_text())
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(ors_server()) if door == "ors" else None
        name, options = door_options(door, url)
        config["env"] = {**config["env"], "name": name, "options": options}
        path = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "config.toml"
        path.write_text(tomlkit.dumps(config))
        result = run_curve(path, [f"run.seed={seed}"], f"the {door} door (seed {seed})")
    return {"door": door, "seed": seed, "env": config["env"]["name"], **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doors", nargs="+", default=list(DOORS), choices=DOORS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--serve", nargs=2, metavar=("PROTOCOL", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    output = RESULTS / "four_doors.json"
    rows: list[dict[str, Any]] = json.loads(output.read_text())["runs"] if output.exists() else []
    done = {(r["door"], r["seed"]) for r in rows}
    for seed in args.seeds:
        for door in args.doors:
            if (door, seed) in done:
                continue
            row = run_door(door, seed)
            rows.append(row)
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(
                json.dumps({"what": __doc__.split("\n\n")[0], "runs": rows}, indent=1)
            )
            curve = row["curve"]
            print(
                f"{door} (seed {seed}): held-out accuracy {curve[0]['accuracy']:.2f} -> "
                f"{curve[-1]['accuracy']:.2f} (best {max(p['accuracy'] for p in curve):.2f}) "
                f"in {row['wall_seconds']:.0f} s",
                flush=True,
            )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
