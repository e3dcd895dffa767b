"""Where the KL reference's forward pass goes: step times of the demo config without KL, with KL
in the loss scored by the trainer's frozen copy (`rl.kl.reference = "trainer"`), and with it
scored by a frozen inference engine as each episode ends (`"inference"`); runs of the three
alternate, so that the machine's load falls on all alike.

Each run is `plait run CONFIG` with the variant's overrides, evaluation only before and after
(`step_time.one_run`); a step's `time/train` holds the training step (with the trainer's
reference, its forward), `time/rollout` the batch's sampling (with the engine's reference, its
forward too), the first step left out (warm-up). Writes benchmarks/results/kl_reference.json.

    python benchmarks/kl_reference.py [--runs 2] [--steps 10] [--config ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

from step_time import DEMO, RESULTS, ROOT, described_head, median_of, one_run

KL = "rl.kl={{coef=0.1, estimator='k3', where='loss', reference='{}'}}"
VARIANTS: dict[str, tuple[str, ...]] = {
    "no_kl": (),
    "trainer": (KL.format("trainer"), "trainer.options.reference=true"),
    "inference": (KL.format("inference"),),
}
PARTS = ("total", "train", "rollout")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEMO)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    head = described_head()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for n in range(args.runs):
        for name, overrides in VARIANTS.items():
            run = one_run(ROOT, args.config, args.steps, overrides)
            runs[name].append(run)
            step, train = (statistics.median(run[part][1:]) for part in ("total", "train"))
            print(
                f"[{n + 1}/{args.runs}] {name}: step {step:.2f} s, train {train:.2f} s", flush=True
            )
    medians = {name: {part: median_of(rs, part) for part in PARTS} for name, rs in runs.items()}
    result = {
        "what": __doc__.split("\n\n")[0],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "config": str(args.config.relative_to(ROOT)),
        "head": head,
        "steps": args.steps,
        "variants": {name: list(overrides) for name, overrides in VARIANTS.items()},
        "runs": runs,
        "median_step_seconds": medians,
        "over_no_kl": {
            name: {part: medians[name][part] / medians["no_kl"][part] for part in PARTS}
            for name in VARIANTS
        },
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kl_reference.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["over_no_kl"], indent=1))


if __name__ == "__main__":
    main()
