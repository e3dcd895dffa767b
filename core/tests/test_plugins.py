"""Plugin discovery: built-ins, entry points, allow/block lists, bad hookimpls, lazy imports."""

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from importlib import resources

import pytest

from plait import kinds
from plait.errors import PluginError, UnknownComponentError
from plait.plugins import Factory, Registry, get_plugin_manager, get_registry


def run_python(code: str, tmp_path, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def make_distribution(root, name: str, module_source: str) -> None:
    """A real installed distribution (dist-info + entry point) on a directory put on sys.path."""
    (root / f"{name}.py").write_text(textwrap.dedent(module_source))
    info = root / f"{name}-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[plait]\n{name} = {name}\n")


GOOD_PLUGIN = """
from plait.hookspecs import hookimpl

@hookimpl
def plait_register_envs(register):
    register("demo.env", "json:loads", description="not a real env, only a name")
"""


def test_builtins_register_through_the_hooks():
    registry = get_registry()
    assert {"jsonl"} <= set(registry.names(kinds.METRIC_SINK))
    assert registry.get(kinds.METRIC_SINK, "jsonl").plugin == "plait.builtins"


def test_unknown_name_lists_registered_and_says_what_to_install():
    registry = Registry()  # nothing registered: every first-party name is unknown here
    registry.add(Factory(kinds.LOSS, "ppo", "json:loads", plugin="one"))
    with pytest.raises(UnknownComponentError) as info:
        registry.get(kinds.TRAINER_ENGINE, "fsdp2")
    assert "pip install plait-fsdp2" in info.value.fix
    with pytest.raises(UnknownComponentError) as info:
        registry.get("env", "math.gsm8k")  # a prefix entry of the catalogue
    assert "pip install plait-math" in info.value.fix
    with pytest.raises(UnknownComponentError, match='did you mean "ppo"'):
        registry.get(kinds.LOSS, "ppoo")
    with pytest.raises(
        PluginError, match=r'no component kind .trainer. \(did you mean "trainer_engine"'
    ):
        registry.get("trainer", "torch")


def test_catalogue_matches_what_installed_distributions_register():
    """Every first-party distribution that is installed registers exactly what the catalogue says."""
    catalogue = tomllib.loads(resources.files("plait").joinpath("catalogue.toml").read_text())
    manager = get_plugin_manager()
    checked = 0
    for info in manager.plugins.values():
        if info.distribution not in catalogue:
            continue
        registered: dict[str, set[str]] = {}
        for factory in manager.registrations(info.name):
            registered.setdefault(factory.kind.name, set()).add(factory.name)
        listed = catalogue[info.distribution]
        assert set(listed) == set(registered), info.distribution
        for kind, names in listed.items():
            exact = {n for n in names if not n.endswith(".")}
            prefixes = [n for n in names if n.endswith(".")]
            assert exact <= registered[kind], (info.distribution, kind)
            assert all(
                n in exact or any(n.startswith(p) for p in prefixes) for n in registered[kind]
            ), (info.distribution, kind, registered[kind])
        checked += 1
    assert checked >= 1  # the core's own entry at least


def test_duplicate_registration_by_two_plugins_fails():
    registry = Registry()
    registry.add(Factory(kinds.ENV, "x", "a:b", plugin="one"))
    with pytest.raises(PluginError, match="both plugin 'one' and plugin 'two'"):
        registry.add(Factory(kinds.ENV, "x", "a:b", plugin="two"))


def test_entry_point_plugin_is_discovered_with_version(tmp_path):
    make_distribution(tmp_path, "plaitdemo", GOOD_PLUGIN)
    out = run_python(
        """
        import json
        from plait.plugins import get_plugin_manager
        pm = get_plugin_manager()
        info = pm.plugins["plaitdemo"]
        print(json.dumps([info.distribution, info.version, pm.registry.get("env", "demo.env").plugin]))
    """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["plaitdemo", "0.3", "plaitdemo"]


@pytest.mark.parametrize(
    "env_extra, expected",
    [
        ({"PLAIT_BLOCK_PLUGINS": "plaitdemo"}, False),
        ({"PLAIT_PLUGINS": "none"}, False),
        ({"PLAIT_PLUGINS": "plaitdemo"}, True),
    ],
)
def test_allow_and_block_lists(tmp_path, env_extra, expected):
    make_distribution(tmp_path, "plaitdemo", GOOD_PLUGIN)
    out = run_python(
        """
        from plait.plugins import get_plugin_manager
        print("plaitdemo" in get_plugin_manager().plugins)
    """,
        tmp_path,
        env_extra,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(expected)


def test_hookimpl_without_spec_fails_at_startup_naming_the_plugin(tmp_path):
    (tmp_path / "typo_plugin.py").write_text(
        textwrap.dedent("""
        from plait.hookspecs import hookimpl

        @hookimpl
        def plait_register_trainer_engine(register):  # missing the final "s"
            pass
    """)
    )
    out = run_python(
        "from plait.plugins import get_plugin_manager; get_plugin_manager()",
        tmp_path,
        {"PLAIT_PLUGIN_MODULES": "typo_plugin"},
    )
    assert out.returncode != 0
    assert "typo_plugin" in out.stderr and "does not define" in out.stderr


def test_cli_reports_plugin_errors_without_traceback(tmp_path):
    (tmp_path / "typo_plugin.py").write_text(
        "from plait.hookspecs import hookimpl\n@hookimpl\ndef plait_nope(register):\n    pass\n"
    )
    out = run_python(
        "from plait.cli import main; main()", tmp_path, {"PLAIT_PLUGIN_MODULES": "typo_plugin"}
    )
    assert out.returncode == 2
    assert out.stderr.startswith("error: plugin 'typo_plugin'")
    assert "Traceback" not in out.stderr


def test_loading_all_plugins_imports_no_torch(tmp_path):
    out = run_python(
        """
        import sys
        from plait.plugins import get_plugin_manager
        pm = get_plugin_manager()
        heavy = sorted(m for m in ("torch", "transformers", "vllm", "megatron", "docker") if m in sys.modules)
        print(len(pm.plugins), heavy)
    """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    count, heavy = out.stdout.split(" ", 1)
    assert int(count) >= 1
    assert heavy.strip() == "[]"


def test_plugins_command_lists_what_each_plugin_registers(tmp_path):
    make_distribution(tmp_path, "plaitdemo", GOOD_PLUGIN)
    out = run_python(
        "import sys; sys.argv = ['plait', 'plugins', '--json']; from plait.cli import main; main()",
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    rows = {row["plugin"]: row for row in json.loads(out.stdout)}
    assert rows["plaitdemo"]["registers"] == {"env": ["demo.env"]}
    assert rows["plaitdemo"]["version"] == "0.3"
    assert "jsonl" in rows["plait.builtins"]["registers"]["metric_sink"]
