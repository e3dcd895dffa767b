"""`plait env new NAME`: a pip-installable environment plugin that passes its own tests at once."""

from __future__ import annotations

import keyword
import re
from pathlib import Path

from plait.api import PlaitError

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def _files(name: str) -> dict[str, str]:
    cls = "".join(part.capitalize() for part in name.split("_")) + "Env"
    package = f"plait_{name}"
    dist = f"plait-{name.replace('_', '-')}"
    return {
        "pyproject.toml": f'''[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{dist}"
version = "0.1.0"
description = "The {name} environment for plait."
readme = "README.md"
requires-python = ">=3.11"
dependencies = ["plait", "plait-sdk"]

[project.optional-dependencies]
test = ["pytest>=8"]

[project.entry-points.plait]
{name} = "{package}.plugin"

[tool.hatch.build.targets.wheel]
packages = ["src/{package}"]

[tool.pytest.ini_options]
addopts = "-ra"
''',
        "README.md": f'''# {dist}

A plait environment. Install it (`pip install -e .`), then:

- train on it: `env.name = "{name}"` in a run config;
- serve it over ORS: `plait env serve {name}`;
- test it: `pytest` (runs plait's environment contract kit in-process and over HTTP).

The environment is in `src/{package}/env.py`.
''',
        f"src/{package}/__init__.py": f'''"""The {name} environment for plait."""

from {package}.env import {cls}

__all__ = ["{cls}"]
''',
        f"src/{package}/env.py": f'''\
"""An example environment: guess a number; each guess is told "higher" or "lower".

Replace the tasks, the prompt and the tools with your own.
"""

from __future__ import annotations

from plait_sdk import Environment, Split, TextBlock, ToolOutput, tool

_TASKS = {{
    "train": [{{"secret": n, "low": 1, "high": 20}} for n in (3, 7, 11, 14, 18)],
    "test": [{{"secret": n, "low": 1, "high": 20}} for n in (5, 16)],
}}


class {cls}(Environment):
    """Find the secret number in as few guesses as possible."""

    @classmethod
    def list_splits(cls) -> list[Split]:
        return [Split("train", "train"), Split("test", "test")]

    @classmethod
    def list_tasks(cls, split: str) -> list[dict]:
        return _TASKS[split]

    def setup(self) -> None:
        self.guesses = 0

    def get_prompt(self) -> list[TextBlock]:
        low, high = self.task_spec["low"], self.task_spec["high"]
        text = f"I picked a whole number from {{low}} to {{high}}. Find it with the guess tool."
        return [TextBlock(text)]

    @tool
    def guess(self, number: int) -> ToolOutput:
        """Guess the number; the answer says whether the secret is higher or lower."""
        self.guesses += 1
        secret = self.task_spec["secret"]
        if number == secret:
            return ToolOutput(blocks=[TextBlock(f"Correct, after {{self.guesses}} guesses.")],
                              reward=1.0 / self.guesses, finished=True)
        hint = "higher" if secret > number else "lower"
        return ToolOutput(blocks=[TextBlock(f"No: the number is {{hint}} than {{number}}.")],
                          reward=0.0)
''',
        f"src/{package}/plugin.py": f'''\
"""Registers the environment with plait (entry point group "plait")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.api import RegisterEnv, hookimpl

if TYPE_CHECKING:
    from plait_sdk import LocalEnvironment


def make_env(*, options: None = None) -> LocalEnvironment:
    # imported here, so that plugin discovery (which imports this module) stays light
    from plait_sdk import LocalEnvironment
    from {package}.env import {cls}

    return LocalEnvironment({cls}, name="{name}")


@hookimpl
def plait_register_envs(register: RegisterEnv) -> None:
    register(
        "{name}",
        "{package}.plugin:make_env",
        description="{cls}: guess a number (example)",
    )
''',
        f"tests/test_{name}.py": f'''\
"""The contract kit checks the environment in-process and through an ORS server and client."""

from __future__ import annotations

from plait.api import build
from plait_sdk.testing import check_sdk_environment
from {package}.env import {cls}


def _solve(task: dict) -> list[tuple[str, dict]]:
    return [("guess", {{"number": task["low"]}}), ("guess", {{"number": task["secret"]}})]


def test_contract() -> None:
    report = check_sdk_environment({cls}, reward_range=(0.0, 1.0), solve=_solve)
    assert report.episodes > 0


def test_registered_with_plait() -> None:
    env = build("env", "{name}")
    assert env.name == "{name}"


def test_solving_earns_reward() -> None:
    import asyncio

    from plait_sdk import LocalEnvironment

    async def episode() -> float:
        env = LocalEnvironment({cls})
        task = await env.get_task("train", 0)
        session = await env.open(task)
        try:
            total = 0.0
            for name, args in _solve(task):
                out = await session.call(name, args)
                total += out.reward or 0.0
            return total
        finally:
            await session.close()

    assert asyncio.run(episode()) > 0
''',
    }


def scaffold(name: str, parent: Path) -> Path:
    """Write the plugin for environment `name` into `parent/plait-NAME/`; returns that folder."""
    if not _NAME.match(name) or keyword.iskeyword(name):
        raise PlaitError(
            f"environment name {name!r} is not usable as a Python package name",
            fix="use lower-case letters, digits and underscores, starting with a letter "
            "(e.g. myenv)",
        )
    root = parent / f"plait-{name.replace('_', '-')}"
    if root.exists():
        raise PlaitError(f"{root} already exists", fix="choose another name or remove the folder")
    for relative, text in _files(name).items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root
