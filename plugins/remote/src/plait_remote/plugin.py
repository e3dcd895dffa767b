"""plait-remote's plugin module: the "remote" trainer and inference engines, the "pool"
inference engine and environment, the "rollout" environment, the `plait serve trainer`,
`plait serve inference` and `plait serve rollout` commands that they drive, and `plait scale`,
which resizes a running run's pool."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

from plait.api import RegisterEnv, RegisterInferenceEngine, RegisterTrainerEngine, hookimpl


@hookimpl
def plait_register_trainer_engines(register: RegisterTrainerEngine) -> None:
    register(
        "remote",
        "plait_remote.trainer:RemoteTrainer",
        options="plait_remote.options:RemoteTrainerOptions",
        description="any installed trainer engine in a process of its own (plait serve trainer), "
        "launched by the run or attached by URL",
    )


@hookimpl
def plait_register_envs(register: RegisterEnv) -> None:
    register(
        "pool",
        "plait_remote.env_pool:EnvPool.from_options",
        options="plait_remote.options:EnvPoolOptions",
        description="an environment's episodes spread over several ORS servers of it "
        "(or rollout workers), each running at most max_in_flight at once; members added and "
        "drained while a run goes",
    )
    register(
        "rollout",
        "plait_remote.rollout_service:RolloutWorkerEnv.from_options",
        options="plait_remote.rollout_service:RolloutWorkerOptions",
        description="a plait serve rollout worker: it runs whole episodes next to its environment, "
        "sampling from the run's inference service",
    )


@hookimpl
def plait_register_inference_engines(register: RegisterInferenceEngine) -> None:
    register(
        "remote",
        "plait_remote.engine:RemoteEngine",
        options="plait_remote.options:RemoteOptions",
        description="any installed inference engine in a process of its own "
        "(plait serve inference), launched by the run or attached by URL",
    )
    register(
        "pool",
        "plait_remote.pool:PoolEngine",
        options="plait_remote.options:PoolOptions",
        description="several inference engines behind one: routed by measured load, "
        "failed requests re-issued, replicas added and drained while a run goes",
    )


def _service_command(
    group: click.Group,
    name: str,
    help: str,
    example: str,
    port: int,
    serve: Callable[[], Callable[..., None]],
) -> None:
    @group.command(name=name, help=help)
    @click.argument(
        "config", type=click.Path(dir_okay=False, exists=True, path_type=Path), required=False
    )
    @click.option(
        "-s",
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help=f"Override a config value, e.g. -s {example}.",
    )
    @click.option("--host", default="127.0.0.1", show_default=True)
    @click.option("--port", default=port, show_default=True, help="0 = a free port.")
    @click.option(
        "--api-key",
        envvar="PLAIT_API_KEY",
        default=None,
        help="Required of every request but GET /health (env PLAIT_API_KEY); "
        "required to bind beyond loopback.",
    )
    def command(
        config: Path | None, overrides: tuple[str, ...], host: str, port: int, api_key: str | None
    ) -> None:
        serve()(config, overrides, host=host, port=port, api_key=api_key)


@hookimpl
def plait_register_commands(cli: click.Group) -> None:
    from plait_sdk.server import serve_group

    group = serve_group(cli)

    def inference() -> Callable[..., None]:
        from plait_remote.inference_service import serve_inference

        return serve_inference

    def trainer() -> Callable[..., None]:
        from plait_remote.trainer_service import serve_trainer

        return serve_trainer

    def rollout() -> Callable[..., None]:
        from plait_remote.rollout_service import serve_rollout

        return serve_rollout

    for section, port, serve in [("inference", 8300, inference), ("trainer", 8400, trainer)]:
        _service_command(
            group,
            section,
            f"Serve the {section} engine of run config CONFIG (its [model] and "
            f"[{section}] sections) over HTTP, for runs whose {section}.engine is "
            '"remote".',
            f"{section}.engine=torch",
            port,
            serve,
        )
    _service_command(
        group,
        "rollout",
        "Serve a rollout worker of run config CONFIG (its [model], [renderer] and "
        "[env]): the environment over ORS, and whole episodes run next to it that "
        "sample from the run's inference service, for runs whose env.name is "
        '"rollout" (or a "pool" with options.rollout_config).',
        "env.name=math.arith",
        8500,
        rollout,
    )

    @cli.command(
        name="scale",
        help="Resize a running run's pools: plait scale RUN_DIR inference=N env=M (the "
        'section\'s component is "pool" with options.scale_file set).',
    )
    @click.argument("run_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
    @click.argument("sizes", nargs=-1, required=True, metavar="inference=N env=M")
    def scale_command(run_dir: Path, sizes: tuple[str, ...]) -> None:
        from plait_remote.scale import SCALABLE, scale, scale_file_of

        for size in sizes:
            section, _, count = size.partition("=")
            if section not in SCALABLE or not count.strip().isdigit():
                raise click.UsageError(
                    f"{size!r}: give {' or '.join(f'{s}=N' for s in SCALABLE)} (N members of "
                    "that pool)"
                )
            path = scale(run_dir, section, int(count))
            click.echo(
                f"asked the {section} pool of {run_dir} for {count} (written to {path}; "
                f"the run reads it every {scale_file_of(run_dir, section)[1]:g} s)"
            )
