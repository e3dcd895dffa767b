"""plait-remote's plugin module: the "remote" inference engine and `plait serve inference`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from plait.hookspecs import hookimpl


@hookimpl
def plait_register_inference_engines(register: Any) -> None:
    register("remote", "plait_remote.engine:RemoteEngine", options="plait_remote.options:RemoteOptions",
             description="any installed inference engine in a process of its own (plait serve inference), "
                         "launched by the run or attached by URL")


@hookimpl
def plait_register_commands(cli: Any) -> None:
    from plait_sdk.server import serve_group

    @serve_group(cli).command()
    @click.argument("config", type=click.Path(dir_okay=False, exists=True, path_type=Path), required=False)
    @click.option("-s", "--set", "overrides", multiple=True, metavar="KEY=VALUE",
                  help="Override a config value, e.g. -s inference.engine=torch.")
    @click.option("--host", default="127.0.0.1", show_default=True)
    @click.option("--port", default=8300, show_default=True, help="0 = a free port.")
    @click.option("--api-key", envvar="PLAIT_API_KEY", default=None,
                  help="Required of every request but GET /health (env PLAIT_API_KEY); "
                       "required to bind beyond loopback.")
    def inference(config: Path | None, overrides: tuple[str, ...], host: str, port: int, api_key: str | None) -> None:
        """Serve the inference engine of run config CONFIG (its [model] and [inference] sections)
        over HTTP, for runs whose inference.engine is "remote"."""
        from plait_remote.service import serve_inference

        serve_inference(config, overrides, host=host, port=port, api_key=api_key)
