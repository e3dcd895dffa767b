"""The plugin module (entry point `countdown_env`): lazy targets, so discovery imports no SDK
code."""

from plait.api import RegisterEnv, hookimpl


@hookimpl
def plait_register_envs(register: RegisterEnv) -> None:
    register(
        "countdown",
        "plait_countdown_env.env:make_env",
        options="plait_countdown_env.env:CountdownOptions",
        description="reach a target number from given numbers with + - * / (the Countdown game)",
    )
