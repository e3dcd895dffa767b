"""plait-proxy's plugin: the `proxy.harness` environment and `plait serve proxy`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from plait.hookspecs import hookimpl


@hookimpl
def plait_register_envs(register: Any) -> None:
    register("proxy.harness", "plait_proxy.harness:make_harness_env", options="plait_proxy.harness:HarnessOptions",
             description="tasks of another environment played by an unmodified agent program through the proxy "
                         "(options: tasks, command)")


@hookimpl
def plait_register_commands(cli: Any) -> None:
    from plait_sdk.server import serve_group

    @serve_group(cli).command()
    @click.argument("config", type=click.Path(dir_okay=False, path_type=Path), required=False)
    @click.option("-s", "--set", "overrides", multiple=True, metavar="KEY=VALUE",
                  help="Override a config value, e.g. -s model.name=tiny-qwen3.")
    @click.option("--host", default="127.0.0.1", show_default=True,
                  help="Address to bind; anything but loopback needs --api-key.")
    @click.option("--port", default=8000, show_default=True, type=int)
    @click.option("--api-key", envvar="PLAIT_PROXY_API_KEY", default=None,
                  help="Require this key (Bearer or x-api-key); sessions then come from the path or "
                       "the X-Plait-Session header.")
    @click.option("--store", "store_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                  help="Append every finished session (token ids, logprobs, weight versions) to "
                       "STORE/sessions.jsonl.")
    def proxy(config: Path | None, overrides: tuple[str, ...], host: str, port: int, api_key: str | None,
              store_dir: Path | None) -> None:
        """OpenAI- and Anthropic-compatible endpoints for the model, engine and renderer of the run
        config CONFIG, recording what they sample per session."""
        import asyncio
        import contextlib

        from plait.config import load_config
        from plait.logs import configure
        from plait_proxy.app import ProxyApp, ServeOptions
        from plait_proxy.proxy import build_proxy
        from plait_proxy.store import RolloutStore
        from plait_sdk.server import is_loopback

        if not is_loopback(host) and not api_key:
            raise click.UsageError(f"--host {host} serves beyond this machine: give --api-key too")
        cfg = load_config(config, overrides)
        configure(cfg.run.log_level)

        async def serve_forever() -> None:
            proxy = build_proxy(cfg)
            app = ProxyApp(proxy, RolloutStore(directory=store_dir), ServeOptions(host, port, api_key))
            async with app.serving() as url:
                click.echo(f"plait proxy for {proxy.model_name} on {url}  (OpenAI: {url}/v1, "
                           f"Anthropic: {url}; per session: {url}/s/<id>/v1)")
                await asyncio.Event().wait()

        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a foreground server stops
            asyncio.run(serve_forever())
