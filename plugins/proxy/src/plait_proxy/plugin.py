"""plait-proxy's plugin: the `proxy.harness` and `verifiers` environments, `plait serve proxy` and
`plait serve online`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

from plait.api import RegisterEnv, hookimpl


@hookimpl
def plait_register_envs(register: RegisterEnv) -> None:
    register(
        "proxy.harness",
        "plait_proxy.harness:make_harness_env",
        options="plait_proxy.harness:HarnessOptions",
        description="tasks of another environment played by an unmodified agent program "
        "through the proxy (options: tasks, command)",
    )
    register(
        "verifiers",
        "plait_proxy.verifiers:make_verifiers_env",
        options="plait_proxy.verifiers:VerifiersOptions",
        description="a verifiers (0.1.x) environment, unmodified: its tasks, rollout and rubric, "
        "its model calls through the proxy (options: environment, args; the venv of "
        "scripts/ci/verifiers.sh)",
    )


@hookimpl
def plait_register_commands(cli: click.Group) -> None:
    from plait_sdk.server import serve_group

    @serve_group(cli).command()
    @click.argument("config", type=click.Path(dir_okay=False, path_type=Path), required=False)
    @_serving(
        "model.name=tiny-qwen3", "sessions then come from the path or the X-Plait-Session header"
    )
    @click.option(
        "--store",
        "store_dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Append every finished session (token ids, logprobs, weight versions) to "
        "STORE/sessions.jsonl.",
    )
    def proxy(
        config: Path | None,
        overrides: tuple[str, ...],
        host: str,
        port: int,
        api_key: str | None,
        served_model_names: tuple[str, ...],
        store_dir: Path | None,
    ) -> None:
        """OpenAI- and Anthropic-compatible endpoints for the model, engine and renderer of the run
        config CONFIG, recording what they sample per session."""
        import asyncio
        import contextlib

        from plait.api import configure_logging, load_config, structure
        from plait_proxy.app import ProxyApp, ProxyOptions, ServeOptions
        from plait_proxy.proxy import build_proxy
        from plait_proxy.store import RolloutStore
        from plait_sdk.server import is_loopback

        if not is_loopback(host) and not api_key:
            raise click.UsageError(f"--host {host} serves beyond this machine: give --api-key too")
        cfg = load_config(config, overrides)
        configure_logging(cfg.run.log_level)
        options = structure(ProxyOptions, cfg.serve.get("proxy", {}), "serve.proxy")
        names = served_model_names or options.served_model_names

        async def serve_forever() -> None:
            proxy = build_proxy(cfg)
            app = ProxyApp(
                proxy,
                RolloutStore(directory=store_dir),
                ServeOptions(host, port, api_key, served_model_names=names),
            )
            async with app.serving() as url:
                click.echo(
                    f"plait proxy for {proxy.model_name} on {url}  (OpenAI: {url}/v1, "
                    f"Anthropic: {url}; per session: {url}/s/<id>/v1)"
                )
                await asyncio.Event().wait()

        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a foreground server stops
            asyncio.run(serve_forever())

    @serve_group(cli).command()
    @click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
    @_serving("serve.online.batch_size=16", "every endpoint then asks for it")
    @click.option(
        "--fresh",
        is_flag=True,
        help="Start over: delete the run directory (run.out_dir/run.name: "
        "the online record, the promoted state, the metrics) instead of resuming from it.",
    )
    def online(
        config: Path,
        overrides: tuple[str, ...],
        host: str,
        port: int,
        api_key: str | None,
        served_model_names: tuple[str, ...],
        fresh: bool,
    ) -> None:
        """Online RL: serve the policy of the run config CONFIG to live clients (OpenAI and
        Anthropic APIs), take rewards at POST /v1/feedback, train on them, and let a version
        serve only once it passes the held-out gate (options: [serve.online])."""
        import asyncio
        import contextlib

        from plait.api import configure_logging, load_config
        from plait_proxy.app import ServeOptions
        from plait_proxy.online import online_options, online_server
        from plait_sdk.server import is_loopback

        if not is_loopback(host) and not api_key:
            raise click.UsageError(f"--host {host} serves beyond this machine: give --api-key too")
        cfg = load_config(config, overrides)
        configure_logging(cfg.run.log_level)
        names = served_model_names or online_options(cfg).served_model_names
        serve = ServeOptions(host, port, api_key, served_model_names=names)

        async def serve_forever() -> None:
            async with online_server(cfg, serve, fresh=fresh) as (url, server):
                click.echo(
                    f"plait online for {cfg.model.name} on {url}  "
                    f"(OpenAI: {url}/v1, Anthropic: {url}); "
                    f"rewards: POST {url}/v1/feedback; status: GET {url}/v1/online/status; "
                    f"serving version {server.serving_version}",
                    err=True,
                )
                await asyncio.Event().wait()

        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_forever())


def _serving(
    override_example: str, with_key: str
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The options of a served command: config overrides, where to listen, the API key."""

    def add(command: Callable[..., None]) -> Callable[..., None]:
        for option in reversed(
            [
                click.option(
                    "-s",
                    "--set",
                    "overrides",
                    multiple=True,
                    metavar="KEY=VALUE",
                    help=f"Override a config value, e.g. -s {override_example}.",
                ),
                click.option(
                    "--host",
                    default="127.0.0.1",
                    show_default=True,
                    help="Address to bind; anything but loopback needs --api-key.",
                ),
                click.option("--port", default=8000, show_default=True, type=int),
                click.option(
                    "--api-key",
                    envvar="PLAIT_PROXY_API_KEY",
                    default=None,
                    help=f"Require this key (Bearer or x-api-key); {with_key}.",
                ),
                click.option(
                    "--served-model-name",
                    "served_model_names",
                    multiple=True,
                    metavar="NAME",
                    help="Another name clients may call the model by (repeatable; replaces "
                    "served_model_names of the config's [serve.<command>]); any other model "
                    "is a 404.",
                ),
            ]
        ):
            command = option(command)
        return command

    return add
