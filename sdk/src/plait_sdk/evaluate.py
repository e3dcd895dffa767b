"""`plait eval`: a model on an environment's held-out tasks, outside a run.

It does what the run loop's evaluation does (`plait.api.evaluate_held_out`), but keeps every
episode: per task one greedy episode (temperature 0; pass@1) and, with `eval.samples_per_task`
k > 1, k more at `eval.temperature` (pass@k, the unbiased estimator `plait.api.pass_at_k`). The
model, inference engine and renderer are the run config's; given a run's checkpoint, the
checkpoint's trainer state is loaded into the run's trainer and pushed to its engines with the
run's own weight sync, so the engines sample the trained weights.

A row per task (JSONL): `index`, `task`, then per episode `rewards`, `correct`, `errors` and
`completions` (the decoded text of each model call); episode 0 is the greedy one.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs

from plait.api import (
    Components,
    ConfigError,
    ModelError,
    RunConfig,
    Trajectory,
    all_or_none,
    build_components,
    close_components,
    console,
    episode_config,
    load_config,
    pass_at_k,
    publish_policy,
    run_episode,
)

T = TypeVar("T")

CHECKPOINTS = "checkpoints"
"""The run directory's folder of checkpoints (`plait run` writes checkpoints/step_N)."""
RUN_CONFIG = "config.toml"
"""The run's complete config, which `plait run` writes into its run directory."""


@attrs.frozen
class EvalSettings:
    """What the command line overrides of the config (None: the config's)."""

    env: str | None = None
    env_options: tuple[str, ...] = ()
    split: str | None = None
    tasks: int | None = None
    samples: int | None = None
    temperature: float | None = None


@attrs.frozen
class Source:
    """A run config, and the checkpoint whose weights to evaluate (None: the config's model)."""

    config: Path
    checkpoint: Path | None = None


def resolve_source(path: Path) -> Source:
    """A run config TOML, a checkpoint (checkpoints/step_N of a run directory), or a run
    directory (its newest checkpoint)."""
    if path.is_file():
        return Source(path)
    if not path.is_dir():
        raise ConfigError(
            "",
            f"no run config or checkpoint at {path}",
            fix="pass a run config (.toml), a run directory, or one of its checkpoints/step_N",
        )
    if (path / "controller.json").is_file():  # a checkpoint: RUN_DIR/checkpoints/step_N
        run_dir, checkpoint = path.parent.parent, path
    elif (path / CHECKPOINTS).is_dir() or (path / RUN_CONFIG).is_file():
        run_dir = path
        saved = sorted((path / CHECKPOINTS).glob("step_*"))
        if not saved:
            raise ModelError(
                f"run directory {path} has no checkpoint ({CHECKPOINTS}/step_N)",
                fix="let the run save one (it does at its end; checkpoint.every for more), or "
                f"pass its {RUN_CONFIG} to evaluate the model it started from",
            )
        checkpoint = saved[-1]
    else:
        raise ModelError(
            f"{path} is neither a run directory nor a checkpoint (no {CHECKPOINTS}/ nor "
            "controller.json)",
            fix="pass a run config (.toml), a run directory, or one of its checkpoints/step_N",
        )
    config = run_dir / RUN_CONFIG
    if not config.is_file():
        raise ModelError(
            f"checkpoint {checkpoint} has no run config at {config}",
            fix=f"pass the run's config: plait eval CONFIG.toml, with model.name set to the model "
            f"(or copy it to {config})",
        )
    return Source(config, checkpoint)


def eval_config(path: Path, settings: EvalSettings) -> RunConfig:
    """The config at `path` with the command line's env and eval settings over it, and no metric
    sinks (an evaluation writes into no run directory)."""
    overrides = ["metrics.sinks=[]"]
    if settings.env is not None:
        overrides.append(f"env.name={json.dumps(settings.env)}")
        if load_config(path).env.name != settings.env:  # another env's options would not fit
            overrides.append("env.options={}")
    for pair in settings.env_options:
        key, sep, _ = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                "env.options",
                f"--env-option {pair!r} is not KEY=VALUE",
                fix="give each option as --env-option KEY=VALUE, e.g. --env-option tasks=8",
            )
        overrides.append(f"env.options.{pair}")
    for key, value in (
        ("env.eval_split", None if settings.split is None else json.dumps(settings.split)),
        ("eval.tasks", settings.tasks),
        ("eval.samples_per_task", settings.samples),
        ("eval.temperature", settings.temperature),
    ):
        if value is not None:
            overrides.append(f"{key}={value}")
    return load_config(path, overrides)


async def load_weights(c: Components, checkpoint: Path) -> None:
    """Each policy's trainer state from `checkpoint`, pushed to its inference engines."""
    for policy in c.policies:
        # as plait run names them: one policy's state is trainer/, several's trainer-NAME/
        state = checkpoint / ("trainer" if len(c.policies) == 1 else f"trainer-{policy.name}")
        if not state.is_dir():
            raise ModelError(
                f"checkpoint {checkpoint} holds no trainer state for policy {policy.name!r} "
                f"({state.name}/)",
                fix="pass a checkpoint that this run's config wrote, or a run directory",
            )
        policy.trainer.load_state(state)
        await publish_policy(c, policy)


def completions(c: Components, t: Trajectory) -> list[str]:
    """The decoded text of each model call of an episode, by the tokenizer of the policy that
    made it."""
    players = {r: next(p for p in c.policies if c.plays(p, r)) for r in t.acting_roles()}
    return [
        players[turn.role].renderer.tokenizer.decode(list(turn.completion.tokens))
        for turn in t.turns
    ]


def task_row(
    c: Components, index: int, task: Mapping[str, Any], episodes: Sequence[Trajectory]
) -> dict[str, Any]:
    return {
        "index": index,
        "task": dict(task),
        "rewards": [t.reward for t in episodes],
        "correct": [bool(t.correct) for t in episodes],
        "errors": [t.error for t in episodes],
        "completions": [completions(c, t) for t in episodes],
    }


async def evaluate(
    config: RunConfig, c: Components, on_task: Callable[[int], None] = lambda _n: None
) -> list[dict[str, Any]]:
    """One row per task of the first `eval.tasks` of `env.eval_split`, every episode at once
    (the engine batches them); `on_task(number of tasks)` is called as each task's episodes
    are done."""
    split, ec, seed = config.env.eval_split, config.eval, config.run.seed
    names = [s.name for s in await c.env.splits()]
    if split not in names:
        raise ConfigError(
            "env.eval_split",
            f"environment {config.env.name!r} has no split {split!r} (it has "
            f"{', '.join(names) or 'none'})",
            fix=f"pass --split with one of: {', '.join(names)}",
        )
    n = min(ec.tasks, await c.env.num_tasks(split))
    k = ec.samples_per_task if ec.samples_per_task > 1 else 0
    actor = c.policies[0].actor

    async def one(index: int) -> dict[str, Any]:
        task = await c.env.get_task(split, index)
        settings = [episode_config(config.rl, 0.0, seed * 1_000_003 + index)] + [
            episode_config(config.rl, ec.temperature, seed * 1_000_003 + n + index * k + j)
            for j in range(k)
        ]
        episodes = await all_or_none(
            [run_episode(c.env, task, *actor, s, c.roles()) for s in settings]
        )
        on_task(n)
        return task_row(c, index, task, episodes)

    return await all_or_none([one(i) for i in range(n)])


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize(rows: Sequence[Mapping[str, Any]], samples: int) -> dict[str, float]:
    """Mean reward and pass@1 of the greedy episodes (episode 0; errors count as wrong, as in
    the run loop's eval), and with `samples` k > 1, pass@k over the k sampled episodes of each
    task (those that lost a sample to an environment error are left out, as in the run loop)."""
    summary = {
        "tasks": float(len(rows)),
        "reward": _mean([row["rewards"][0] for row in rows]),
        "pass@1": _mean([float(row["correct"][0]) for row in rows]),
        "errors": float(sum(error is not None for row in rows for error in row["errors"])),
    }
    if samples > 1:
        valid = [
            [
                ok
                for ok, error in zip(row["correct"][1:], row["errors"][1:], strict=True)
                if not error
            ]
            for row in rows
        ]
        complete = [v for v in valid if len(v) >= samples]
        summary[f"pass@{samples}"] = _mean([pass_at_k(len(v), sum(v), samples) for v in complete])
        summary["k"] = float(samples)
    return summary


def summary_line(config: RunConfig, summary: Mapping[str, float]) -> str:
    ec = config.eval
    parts = [
        f"eval {config.env.name} [{config.env.eval_split}]: {int(summary['tasks'])} tasks",
        f"mean reward {summary['reward']:.4f}",
        f"pass@1 {summary['pass@1']:.4f} (greedy)",
    ]
    if ec.samples_per_task > 1:
        k = ec.samples_per_task
        parts.append(f"pass@{k} {summary[f'pass@{k}']:.4f} ({k} samples at T={ec.temperature:g})")
    if summary["errors"]:
        parts.append(f"{int(summary['errors'])} episodes failed")
    return ", ".join(parts)


def run_eval(
    path: Path, settings: EvalSettings, output: Path | None = None
) -> tuple[RunConfig, dict[str, float]]:
    """Evaluate what `path` names (config, run directory or checkpoint); write the rows to
    `output` when given; return the config used and the summary."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    source = resolve_source(path)
    config = eval_config(source.config, settings)
    with tempfile.TemporaryDirectory(prefix="plait-eval-") as scratch:
        components = build_components(config, Path(scratch))

        async def main() -> list[dict[str, Any]]:
            try:
                if source.checkpoint is not None:
                    await load_weights(components, source.checkpoint)
                with Progress(
                    TextColumn("eval"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    console=console,
                    disable=not console.is_terminal,
                    transient=True,
                ) as progress:
                    bar = progress.add_task("eval", total=config.eval.tasks)
                    return await evaluate(
                        config, components, lambda n: progress.update(bar, total=n, advance=1)
                    )
            finally:
                await close_components(components)

        rows = asyncio.run(main())
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        with output.open("w") as f:
            f.writelines(json.dumps(row, default=str) + "\n" for row in rows)
    return config, summarize(rows, config.eval.samples_per_task)
