"""plait-docker's plugin module: the code environments and the `plait docker` commands.

Imports nothing heavy: the environments load (and connect to Docker) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.api import RegisterEnv, hookimpl

if TYPE_CHECKING:
    import click

_ENVS = (
    (
        "code.humaneval",
        "humaneval",
        "CodeEnvOptions",
        "HumanEval (164 tasks), graded by its hidden tests in a Docker sandbox; single turn",
    ),
    (
        "code.python",
        "python",
        "CodeEnvOptions",
        "plait's own 20 Python tasks, graded by hidden tests in a Docker sandbox; single turn",
    ),
    (
        "code.humaneval_multiturn",
        "humaneval_multiturn",
        "MultiTurnCodeEnvOptions",
        "HumanEval with a run_python tool before the final answer",
    ),
    (
        "code.python_multiturn",
        "python_multiturn",
        "MultiTurnCodeEnvOptions",
        "plait's own Python tasks with a run_python tool before the final answer",
    ),
)


@hookimpl
def plait_register_envs(register: RegisterEnv) -> None:
    for name, factory, options, description in _ENVS:
        register(
            name,
            f"plait_docker.envs:{factory}",
            options=f"plait_docker.envs:{options}",
            description=description,
        )


@hookimpl
def plait_register_commands(cli: click.Group) -> None:
    from plait_docker.cli import docker_commands

    cli.add_command(docker_commands, name="docker")
