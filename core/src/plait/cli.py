"""The `plait` command line. Plugins add sub-commands through `plait_register_commands`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from plait.errors import PlaitError


@click.group()
@click.version_option(package_name="plait")
def cli() -> None:
    """plait: reinforcement learning for language models, composed from plugins."""


@cli.command()
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path), required=False)
@click.option(
    "-s",
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config value, e.g. -s rl.steps=5 -s trainer.learning_rate=1e-5.",
)
@click.option(
    "--resume/--no-resume",
    default=True,
    show_default=True,
    help="Continue from the run directory's last checkpoint when there is one.",
)
def run(config: Path | None, overrides: tuple[str, ...], resume: bool) -> None:
    """Train with the run config CONFIG (TOML). Without CONFIG, the defaults."""
    from plait.config import load_config
    from plait.logs import configure_logging

    cfg = load_config(config, overrides)
    configure_logging(cfg.run.log_level)
    from plait.run.loop import run_training

    click.echo(run_training(cfg, resume=resume))


@cli.command(name="config")
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path), required=False)
@click.option(
    "-s", "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a value."
)
@click.option(
    "--check/--no-check",
    default=True,
    show_default=True,
    help="Also check that every named component is installed and its options fit.",
)
def show_config(config: Path | None, overrides: tuple[str, ...], check: bool) -> None:
    """Print the complete run config (defaults filled in) as TOML, after validating it."""
    import tomli_w

    from plait.components import validate_components
    from plait.config import load_config
    from plait.schema import unstructure

    cfg = load_config(config, overrides)
    if check:
        validate_components(cfg)
    click.echo(tomli_w.dumps(unstructure(cfg)), nl=False)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plugins(as_json: bool) -> None:
    """List installed plugins, their versions and what each registers."""
    from plait.plugins import get_plugin_manager

    manager = get_plugin_manager()
    rows: list[dict[str, Any]] = []
    for info in manager.plugins.values():
        registered: dict[str, list[str]] = {}
        for factory in manager.registrations(info.name):
            registered.setdefault(factory.kind.name, []).append(factory.name)
        rows.append(
            {
                "plugin": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "module": info.module,
                "registers": registered,
            }
        )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        click.echo(
            f"{row['plugin']}  ({row['distribution']} {row['version']}, module {row['module']})"
        )
        for kind, names in sorted(row["registers"].items()):
            click.echo(f"    {kind:<17} {', '.join(names)}")
        if not row["registers"]:
            click.echo("    (registers no components; it may add CLI commands)")


@cli.command()
def models() -> None:
    """List the model names `model.name` accepts (besides checkpoint directories)."""
    from plait.kinds import MODEL
    from plait.models import cached_model_dir, is_cached
    from plait.plugins import get_registry

    for factory in get_registry().all(MODEL):
        source = factory.load()
        cached = is_cached(cached_model_dir(factory.name, source))
        state = "cached " if cached else "not yet"
        click.echo(f"{factory.name:<28} {state}  {source.description}  [{factory.plugin}]")


def main() -> None:
    from plait.plugins import get_plugin_manager

    try:
        get_plugin_manager().add_commands(cli)
        cli.main(standalone_mode=False)
    except PlaitError as exc:
        if os.environ.get("PLAIT_TRACEBACK"):
            raise
        click.echo(f"error: {exc.message}", err=True)
        if exc.fix:
            click.echo(f"  fix: {exc.fix}", err=True)
        click.echo("  (set PLAIT_TRACEBACK=1 for the traceback)", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
