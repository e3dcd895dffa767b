"""plait-sdk's plugin: the "ors" environment (any ORS server), "skyrl_gym" (skyrl-gym
environments), "openenv" (any OpenEnv server) and the `plait env` commands."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from plait.api import RegisterEnv, hookimpl

if TYPE_CHECKING:
    from plait.api import Environment as EnvironmentProtocol
    from plait_sdk.environment import Environment


@hookimpl
def plait_register_envs(register: RegisterEnv) -> None:
    register(
        "ors",
        "plait_sdk.client:ORSEnvironment.from_options",
        options="plait_sdk.client:ORSOptions",
        description="any Open Reward Standard server (options: url, env_name, api_key, splits)",
    )
    register(
        "skyrl_gym",
        "plait_sdk.skyrl:make_env",
        options="plait_sdk.skyrl:SkyRLGymOptions",
        description="a skyrl-gym environment on SkyRL dataset rows (options: env, data, "
        "env_config, max_turns; needs plait-sdk[skyrl])",
    )
    register(
        "openenv",
        "plait_sdk.openenv_client:OpenEnvEnvironment.from_options",
        options="plait_sdk.openenv_client:OpenEnvOptions",
        description="an OpenEnv (openenv-core) server, reached by url or started from app / "
        "command (options: url, app, command, action_field, action_extra, splits, ...; needs "
        "plait-sdk[openenv])",
    )


def _options(pairs: tuple[str, ...]) -> dict[str, Any]:
    from plait.api import apply_overrides

    return apply_overrides({}, pairs)


def build_environment(
    name: str, options: dict[str, Any]
) -> EnvironmentProtocol | type[Environment]:
    """A registered environment by name, or an SDK class given as "module:Class"."""
    from plait.api import build, load_target

    if ":" in name:
        # fail like a registered environment given an unknown option, not serve without it
        if options:
            from plait.api import ConfigError

            raise ConfigError(
                f"env.options.{sorted(options)[0]}",
                f"unknown key; {name} is given as module:Class, which takes no options "
                f"(got {', '.join(sorted(options))})",
                fix="leave out -o, or register the environment in a plugin with an options "
                "class and serve it by name",
            )
        return load_target(name)
    return build("env", name, options=options, options_path="env.options")


@hookimpl
def plait_register_commands(cli: click.Group) -> None:
    @cli.group()
    def env() -> None:
        """Environments: serve them over ORS or OpenEnv, scaffold new ones."""

    @env.command()
    @click.argument("name")
    @click.option(
        "-o",
        "--option",
        "option_pairs",
        multiple=True,
        metavar="KEY=VALUE",
        help="An option of the environment (its env.options), e.g. -o max_turns=4.",
    )
    @click.option(
        "--host",
        default="127.0.0.1",
        show_default=True,
        help="Address to bind; anything but loopback needs --api-key.",
    )
    @click.option("--port", default=8080, show_default=True, type=int)
    @click.option(
        "--protocol",
        type=click.Choice(["ors", "openenv"]),
        default="ors",
        show_default=True,
        help="The wire: ORS, or OpenEnv (openenv-core's EnvClient over /ws; loopback only, no "
        "API key or session TTL, needs plait-sdk[openenv]).",
    )
    @click.option(
        "--api-key",
        envvar="PLAIT_ORS_API_KEY",
        default=None,
        help="Require this key in X-API-Key (env PLAIT_ORS_API_KEY).",
    )
    @click.option(
        "--session-ttl",
        default=900.0,
        show_default=True,
        type=click.FloatRange(min=0, min_open=True),
        help="Seconds without a request after which a session is deleted (> 0). A running "
        "call or a wait for setup keeps it alive however long; between calls clients ping every "
        "10 s, so a shorter TTL can delete a session while its agent thinks.",
    )
    def serve(
        name: str,
        option_pairs: tuple[str, ...],
        host: str,
        port: int,
        protocol: str,
        api_key: str | None,
        session_ttl: float,
    ) -> None:
        """Serve environment NAME (a registered name, or module:Class) over ORS or OpenEnv."""
        from plait_sdk.server import Server, ServerOptions

        environment = build_environment(name, _options(option_pairs))
        if protocol == "openenv":
            from plait_sdk.openenv_server import OpenEnvServer

            if api_key:
                raise click.UsageError(
                    "--api-key (or PLAIT_ORS_API_KEY): OpenEnv's wire has no API key; serve on "
                    "loopback without one, or use --protocol ors"
                )
            OpenEnvServer(environment).run(host, port)
            return
        Server(
            [environment], options=ServerOptions(api_key=api_key, session_ttl_s=session_ttl)
        ).run(host, port)

    @env.command()
    @click.argument("name")
    @click.option(
        "--dir",
        "parent",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path("."),
        show_default=True,
        help="Where to create the plait-NAME folder.",
    )
    def new(name: str, parent: Path) -> None:
        """Create a pip-installable environment plugin named NAME."""
        from plait_sdk.scaffold import scaffold

        root = scaffold(name, parent)
        click.echo(
            f"created {root}\n  pip install -e {root}\n  pytest {root}\n  plait env serve {name}"
        )

    @env.command(name="list")
    def list_envs() -> None:
        """List the registered environments."""
        from plait.api import ENV, get_registry

        for factory in get_registry().all(ENV):
            click.echo(f"{factory.name:<24} {factory.description}  [{factory.plugin}]")

    @cli.command(name="eval")
    @click.argument("source", metavar="CONFIG_OR_CHECKPOINT", type=click.Path(path_type=Path))
    @click.option("--env", "env_name", default=None, help="Evaluate on this env (env.name).")
    @click.option(
        "--env-option",
        "env_options",
        multiple=True,
        metavar="KEY=VALUE",
        help="An option of the env (env.options), e.g. --env-option tasks=8.",
    )
    @click.option("--split", default=None, help="The split to evaluate on (env.eval_split).")
    @click.option(
        "--tasks", type=click.IntRange(min=1), default=None, help="The first N tasks (eval.tasks)."
    )
    @click.option(
        "--samples",
        type=click.IntRange(min=1),
        default=None,
        help="k of pass@k: sampled episodes per task beside the greedy one "
        "(eval.samples_per_task; 1: greedy only).",
    )
    @click.option(
        "--temperature",
        type=click.FloatRange(min=0),
        default=None,
        help="Temperature of the k samples (eval.temperature).",
    )
    @click.option(
        "--output",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Write one JSONL row per task here.",
    )
    def eval_command(
        source: Path,
        env_name: str | None,
        env_options: tuple[str, ...],
        split: str | None,
        tasks: int | None,
        samples: int | None,
        temperature: float | None,
        output: Path | None,
    ) -> None:
        """Evaluate a model on an env: mean reward, pass@1 (greedy) and pass@k.

        CONFIG_OR_CHECKPOINT is a run config (.toml; its model), a run directory (its newest
        checkpoint) or a checkpoint (RUN_DIR/checkpoints/step_N), evaluated with the run's own
        config.toml. The flags override the config's env and eval settings.
        """
        from plait_sdk.evaluate import EvalSettings, run_eval, summary_line

        settings = EvalSettings(env_name, env_options, split, tasks, samples, temperature)
        config, summary = run_eval(source, settings, output)
        click.echo(summary_line(config, summary) + (f"; rows in {output}" if output else ""))
