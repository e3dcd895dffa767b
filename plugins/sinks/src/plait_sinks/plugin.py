"""The plugin module (entry point `sinks`): the metric sinks and the `plait plot` command."""

from __future__ import annotations

from pathlib import Path

import click

from plait.api import RegisterMetricSink, hookimpl


@hookimpl
def plait_register_metric_sinks(register: RegisterMetricSink) -> None:
    register(
        "console",
        "plait_sinks.console:ConsoleSink",
        options="plait_sinks.console:ConsoleOptions",
        description="one-line summary per step",
    )
    register(
        "dashboard",
        "plait_sinks.dashboard:DashboardSink",
        options="plait_sinks.dashboard:DashboardOptions",
        description="dashboard.png in the run directory, rendered when the run ends "
        "(and every N steps)",
    )
    register(
        "tensorboard",
        "plait_sinks.tensorboard:TensorBoardSink",
        description="TensorBoard event files",
    )


@hookimpl
def plait_register_commands(cli: click.Group) -> None:
    @cli.command()
    @click.argument("run_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
    @click.option(
        "-o",
        "--output",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="PNG to write (default RUN_DIR/dashboard.png).",
    )
    def plot(run_dir: Path, output: Path | None) -> None:
        """Render a run's standard dashboard to PNG."""
        from plait_sinks.plot import plot_run

        click.echo(str(plot_run(run_dir, output)))
