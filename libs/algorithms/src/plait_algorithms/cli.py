"""`plait reward-model train`: a Bradley–Terry reward model from preference pairs
(`plait_algorithms.reward_model`), for the judge environment's `reward_model` option."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import click


@click.group(name="reward-model")
def reward_model_commands() -> None:
    """Reward models: train one on preference pairs, then grade episodes with it (env judge)."""


@reward_model_commands.command()
@click.argument("pairs", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", required=True, help="The model to start from (a name or directory).")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where to write the reward model (env.options.reward_model of a judge run).",
)
@click.option(
    "--held-out",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Pairs to measure accuracy on (default: a tenth of PAIRS, kept out of training).",
)
@click.option("--steps", default=100, show_default=True, type=click.IntRange(min=1))
@click.option("--pairs-per-step", default=16, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--learning-rate", default=1e-4, show_default=True, type=click.FloatRange(min=0, min_open=True)
)
@click.option("--micro-batch-size", default=16, show_default=True, type=click.IntRange(min=1))
@click.option("--eval-every", default=25, show_default=True, type=click.IntRange(min=1))
@click.option("--engine", default="torch", show_default=True, help="The trainer engine.")
@click.option("--renderer", default="chat_template", show_default=True)
@click.option(
    "-o",
    "--option",
    "option_pairs",
    multiple=True,
    metavar="KEY=VALUE",
    help="A trainer engine option (a TOML value), e.g. -o lora='{rank = 8}'.",
)
@click.option("--seed", default=0, show_default=True, type=int)
def train(
    pairs: Path,
    model: str,
    out: Path,
    held_out: Path | None,
    option_pairs: tuple[str, ...],
    **settings: Any,
) -> None:
    """Train a reward model on the preference pairs in PAIRS (JSON lines: prompt, chosen,
    rejected) and save it to --out."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from plait.api import apply_overrides, console
    from plait_algorithms.reward_model import (
        RewardModelSettings,
        read_pairs,
        train_reward_model,
    )

    options = apply_overrides({}, option_pairs)
    training = read_pairs(pairs)
    if held_out is not None:
        measured = read_pairs(held_out)
    else:
        if len(training) < 10:
            raise click.UsageError(
                f"{pairs} holds {len(training)} pairs: too few to keep a tenth out; "
                "give --held-out pairs"
            )
        random.Random(settings["seed"]).shuffle(training)
        cut = len(training) // 10
        measured, training = training[:cut], training[cut:]
    config = RewardModelSettings(model=model, options=options, **settings)
    with Progress(
        TextColumn("reward model"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        console=console,
        disable=not console.is_terminal,
    ) as progress:
        bar = progress.add_task("", total=config.steps)

        def show(row: dict[str, Any]) -> None:
            held = (
                f", held-out accuracy {row['held_out/accuracy']:.2f}"
                if "held_out/accuracy" in row
                else ""
            )
            progress.update(
                bar,
                advance=1,
                description=f"loss {row['loss']:.3f}, batch accuracy {row['accuracy']:.2f}{held}",
            )

        manifest = train_reward_model(config, training, measured, out, show)
    click.echo(
        f"held-out pair accuracy ({manifest['held_out_pairs']} pairs): "
        f"{manifest['held_out_accuracy_before']:.3f} -> {manifest['held_out_accuracy']:.3f}\n"
        f'saved to {out}; grade a run\'s episodes with it: env.name = "judge", '
        f'env.options.reward_model = "{out}"'
    )
