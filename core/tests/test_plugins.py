"""Plugin discovery: built-ins, entry points, allow/block lists, bad hookimpls, lazy imports."""

import ast
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from plait import kinds
from plait.errors import PluginError, UnknownComponentError
from plait.plugins import (
    BUILTIN_PLUGINS,
    ENTRY_POINT_GROUP,
    Factory,
    Registry,
    get_plugin_manager,
    get_registry,
)


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


REPOSITORY = Path(__file__).resolve().parents[2]
EXAMPLE_PLUGINS = REPOSITORY / "examples" / "plugins"
NOT_DISTRIBUTIONS = {"__pycache__", "node_modules", "runs", "src", "tests"}
HOOK_KINDS = {kind.hook: kind.name for kind in kinds.KINDS}


def load_catalogue() -> dict[str, dict[str, list[str]]]:
    return tomllib.loads(resources.files("plait").joinpath("catalogue.toml").read_text())


def module_source(distribution: Path, module: str) -> Path:
    """The source file of `module` in a distribution laid out as src/<package>/."""
    base = distribution / "src" / module.replace(".", "/")
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"


def first_party_plugin_modules() -> dict[str, list[Path]]:
    """Each distribution of this repository with a `plait` entry point (found from the
    pyproject.toml files, so a new one cannot be forgotten), mapped to its plugin modules' source
    files; the core with its built-in plugin modules. The examples under examples/plugins/ are left
    out: see test_every_repository_distribution_that_registers_a_component_is_in_the_catalogue."""
    assert (REPOSITORY / "core" / "pyproject.toml").is_file(), "the tests run from a checkout"
    found = {"plait": [module_source(REPOSITORY / "core", m) for m in BUILTIN_PLUGINS]}
    for folder, subfolders, files in os.walk(REPOSITORY):
        if Path(folder) == EXAMPLE_PLUGINS:
            subfolders.clear()
            continue
        subfolders[:] = [
            s for s in subfolders if not s.startswith(".") and s not in NOT_DISTRIBUTIONS
        ]
        if "pyproject.toml" not in files:
            continue
        project = tomllib.loads((Path(folder) / "pyproject.toml").read_text()).get("project", {})
        entry_points = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
        if entry_points:
            found[project["name"]] = [
                module_source(Path(folder), value.split(":")[0]) for value in entry_points.values()
            ]
    return found


def kinds_registered_in(source: Path) -> set[str]:
    """The component kinds whose register hook a plugin module implements."""
    tree = ast.parse(source.read_text(), str(source))
    return {
        HOOK_KINDS[node.name]
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name in HOOK_KINDS
    }


def test_every_repository_distribution_that_registers_a_component_is_in_the_catalogue():
    """Every distribution of this repository whose plugin module implements a register hook has a
    catalogue entry listing exactly those kinds, and the catalogue names no other distribution. It
    reads the sources, so it holds whatever is installed (the names themselves are checked against
    the installed plugins by the next test).

    The examples under examples/plugins/ are deliberately not first-party: they show how a plugin
    written outside this repository looks, and such a plugin has no entry in the core's catalogue
    (the kernel knows no plugin by name). They are not published either, so an install hint that
    said `pip install plait-csv-sink` would send users to a package that does not exist; they are
    installed from their folders (`pip install -e examples/plugins/<folder>`)."""
    catalogue = load_catalogue()
    distributions = first_party_plugin_modules()
    assert len(distributions) > 1, "found no distribution with a plait entry point"
    for distribution, modules in distributions.items():
        registers = set().union(*(kinds_registered_in(module) for module in modules))
        listed = set(catalogue.get(distribution, {}))
        assert registers == listed, (
            f"{distribution} registers {sorted(registers) or 'nothing'} but the catalogue lists "
            f"{sorted(listed) or 'nothing'}: fix its [{distribution}] table in "
            "core/src/plait/catalogue.toml"
        )
    assert set(catalogue) <= set(distributions), "the catalogue names a distribution not here"


def test_catalogue_matches_what_installed_distributions_register():
    """Every first-party distribution that is installed registers exactly the names the catalogue
    lists for it (a prefix entry covers the names that start with it); one that registers a
    component and is missing from the catalogue fails. Other plugins are not checked."""
    catalogue = load_catalogue()
    first_party = set(first_party_plugin_modules())
    manager = get_plugin_manager()
    registered: dict[str, dict[str, set[str]]] = {}
    for info in manager.plugins.values():
        if info.distribution in first_party:
            by_kind = registered.setdefault(info.distribution, {})
            for factory in manager.registrations(info.name):
                by_kind.setdefault(factory.kind.name, set()).add(factory.name)
    assert "plait" in registered  # the core's own entry at least
    for distribution, by_kind in registered.items():
        listed = catalogue.get(distribution, {})
        assert set(listed) == set(by_kind), (distribution, sorted(by_kind))
        for kind, names in listed.items():
            exact = {n for n in names if not n.endswith(".")}
            prefixes = [n for n in names if n.endswith(".")]
            assert exact <= by_kind[kind], (distribution, kind)
            assert all(
                n in exact or any(n.startswith(p) for p in prefixes) for n in by_kind[kind]
            ), (distribution, kind, by_kind[kind])


@pytest.mark.parametrize(
    "distribution, kind, name",
    [
        (distribution, kind, name)
        for distribution, provides in load_catalogue().items()
        for kind, names in provides.items()
        for name in names
    ],
)
def test_a_catalogued_name_that_is_not_installed_says_what_to_install(distribution, kind, name):
    registry = (
        Registry()
    )  # nothing installed: e.g. inference.engine = "remote" without plait-remote
    asked = f"{name}example" if name.endswith(".") else name
    with pytest.raises(UnknownComponentError) as info:
        registry.get(kind, asked)
    assert f"pip install {distribution} " in info.value.fix


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
        plugin = pm.registry.get("env", "demo.env").plugin
        print(json.dumps([info.distribution, info.version, plugin]))
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
        heavy_modules = ("torch", "transformers", "vllm", "megatron", "docker")
        heavy = sorted(m for m in heavy_modules if m in sys.modules)
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
