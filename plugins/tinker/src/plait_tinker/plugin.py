"""plait-tinker's plugin: the `plait serve tinker` command."""

from __future__ import annotations

from pathlib import Path

import click

from plait.api import hookimpl


@hookimpl
def plait_register_commands(cli: click.Group) -> None:
    from plait_sdk.server import serve_group

    @serve_group(cli).command()
    @click.argument("config", type=click.Path(dir_okay=False, exists=True, path_type=Path))
    @click.option(
        "-s",
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override a config value, e.g. -s server.port=9000.",
    )
    @click.option("--log-level", default="info", show_default=True)
    def tinker(config: Path, overrides: tuple[str, ...], log_level: str) -> None:
        """A Tinker-compatible training service for the base models of CONFIG: point the tinker
        SDK (0.38) or tinker-cookbook at it with TINKER_BASE_URL and TINKER_API_KEY."""
        import asyncio
        import contextlib

        from plait.api import configure_logging
        from plait_sdk.server import is_loopback
        from plait_tinker.app import build_app
        from plait_tinker.config import load_server_config

        cfg, base = load_server_config(config, overrides)
        server = cfg.server
        if not cfg.tenants and not is_loopback(server.host):
            raise click.UsageError(
                f"server.host {server.host} serves beyond this machine: list [[tenants]] "
                "with their api_key first"
            )
        configure_logging(log_level)

        async def serve_forever() -> None:
            app = build_app(cfg, base / server.storage)
            async with app.serving(server.host, server.port) as url:
                click.echo(
                    f"plait tinker service on {url}  (export TINKER_BASE_URL={url} "
                    f"TINKER_API_KEY={'<your key>' if cfg.tenants else 'tml-local'}); "
                    f"base models: {', '.join(cfg.models)}"
                )
                await asyncio.Event().wait()

        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a foreground server stops
            asyncio.run(serve_forever())
