"""The standard dashboard of a run, as one PNG. A run with several policies reports each one's
metrics with an `@NAME` suffix; every panel draws a line per policy beside the run's own."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plait.api import PlaitError, read_jsonl

TIMING_KEYS = ("time/rollout", "time/train", "time/sync", "time/eval")


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in records:
        value = r.get(key)
        if isinstance(value, int | float):
            steps.append(r["step"])
            values.append(float(value))
    return steps, values


def policy_names(run_dir: str | Path) -> list[str]:
    """The policies of a run with several (`[policies.NAME]` in its config.toml); [] otherwise."""
    config = Path(run_dir) / "config.toml"
    return list(tomllib.loads(config.read_text()).get("policies", {})) if config.is_file() else []


def _panel(
    ax: Any,
    records: Sequence[dict[str, Any]],
    keys: Sequence[str],
    title: str,
    policies: Sequence[str],
    *,
    markers: bool = False,
    ylim: tuple[float, float] | None = None,
) -> None:
    drawn = False
    for key in [variant for k in keys for variant in (k, *(f"{k}@{p}" for p in policies))]:
        steps, values = _series(records, key)
        if steps:
            ax.plot(
                steps,
                values,
                marker="o" if markers or len(steps) < 3 else None,
                markersize=4,
                label=key,
            )
            drawn = True
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=8)
    if ylim:
        ax.set_ylim(*ylim)
    if drawn:
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(
            0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray"
        )


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Render reward, held-out accuracy, pass@k, entropy, importance weights, grad norm and the
    timing split of a run to `output` (default RUN_DIR/dashboard.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise PlaitError(
            f"{run_dir} has no metrics.jsonl", fix="pass the directory of a run (runs/<name>)"
        )
    records = read_jsonl(run_dir / "metrics.jsonl")
    if not records:
        raise PlaitError(f"{run_dir}/metrics.jsonl is empty: the run logged no step yet")
    output = Path(output) if output else run_dir / "dashboard.png"

    policies = policy_names(run_dir)
    fig, axes = plt.subplots(3, 3, figsize=(15, 11))
    (a_reward, a_eval, a_passk), (a_entropy, a_iw, a_kl), (a_grad, a_time, a_perf) = axes
    _panel(
        a_reward,
        records,
        ["reward/mean", "reward/pass@1"],
        "training reward",
        policies,
        ylim=(-0.02, 1.02),
    )
    _panel(
        a_eval,
        records,
        ["eval/accuracy", "eval/pass@1"],
        "held-out accuracy",
        policies,
        markers=True,
        ylim=(-0.02, 1.02),
    )
    _panel(
        a_passk, records, ["reward/pass@k", "eval/pass@k"], "pass@k", policies, ylim=(-0.02, 1.02)
    )
    _panel(
        a_entropy,
        records,
        ["policy/entropy", "policy/entropy_sampled"],
        "entropy (nats/token)",
        policies,
    )
    _panel(
        a_iw,
        records,
        ["policy/importance_weight_max", "policy/importance_weight_mean"],
        "importance weight  π_train / π_rollout",
        policies,
    )
    _panel(
        a_kl,
        records,
        ["policy/mismatch_kl", "async/staleness_mean"],
        "mismatch KL, staleness",
        policies,
    )
    _panel(a_grad, records, ["optim/grad_norm"], "grad norm (pre-clip)", policies)
    _timing(a_time, records)
    _panel(
        a_perf,
        records,
        ["perf/tokens_per_s/rollout", "perf/tokens_per_s/train"],
        "tokens / s",
        policies,
    )

    summary_path = run_dir / "summary.json"
    title = run_dir.name
    if summary_path.is_file():
        s = json.loads(summary_path.read_text())
        title += (
            f"  —  {s.get('model', '')} on {s.get('env', '')}: held-out accuracy "
            f"{s['eval_accuracy_start']:.2f} → {s['eval_accuracy_end']:.2f} in {s['steps']} steps, "
            f"{s['seconds'] / 60:.1f} min"
        )
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.stem + ".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(output)
    return output


def _timing(ax: Any, records: Sequence[dict[str, Any]]) -> None:
    """Stacked bars: where each step's wall time went."""
    steps = [r["step"] for r in records if "time/total" in r]
    bottom = [0.0] * len(steps)
    by_step = {r["step"]: r for r in records if "time/total" in r}
    for key in TIMING_KEYS:
        values = [float(by_step[s].get(key, 0.0) or 0.0) for s in steps]
        if any(values):
            ax.bar(steps, values, bottom=bottom, label=key.split("/")[1], width=0.8)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_title("time per step (s)", fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3, axis="y")
    if steps:
        ax.legend(fontsize=7)
