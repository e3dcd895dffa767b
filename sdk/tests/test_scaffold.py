"""`plait env new`: the generated plugin installs into a fresh venv and passes its own tests."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from plait.api import PlaitError
from plait_sdk.scaffold import scaffold

REPO = Path(__file__).resolve().parents[2]
# Third-party packages the generated plugin's tests need at run time and to build (hatchling).
DEPENDENCIES = [
    "pydantic",
    "pydantic_core",
    "uvicorn",
    "httptools",
    "uvloop",
    "httpx",
    "httpcore",
    "anyio",
    "h11",
    "pluggy",
    "attrs",
    "cattrs",
    "structlog",
    "click",
    "rich",
    "numpy",
    "matplotlib",
    "jsonschema",
    "pytest",
    "hypothesis",
    "hatchling",
    "editables",
    "typing_extensions",
]


def test_names_that_are_not_packages_are_refused(tmp_path: Path) -> None:
    for bad in ("My-Env", "1env", "class", ""):
        with pytest.raises(PlaitError, match="not usable as a Python package name"):
            scaffold(bad, tmp_path)
    scaffold("ok_env", tmp_path)
    with pytest.raises(PlaitError, match="already exists"):
        scaffold("ok_env", tmp_path)


def _dependency_dirs() -> list[str]:
    """Where the dependencies live here: the fresh venv sees them through a .pth file (no
    download), but not plait's own distributions, which it installs from this checkout."""
    dirs: list[str] = []
    for name in DEPENDENCIES:
        module = importlib.import_module(name)
        location = Path(module.__file__).resolve().parent.parent  # type: ignore[arg-type]
        if str(location) not in dirs:
            dirs.append(str(location))
    return dirs


@pytest.mark.slow
def test_plait_env_new_passes_its_own_tests_in_a_fresh_venv(tmp_path: Path) -> None:
    made = subprocess.run(
        [sys.executable, "-m", "plait.cli", "env", "new", "myenv", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    package = tmp_path / "plait-myenv"
    assert (package / "pyproject.toml").is_file() and "pip install -e" in made.stdout

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "_plait_test_deps.pth").write_text("\n".join(_dependency_dirs()) + "\n")
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PLAIT_PLUGINS")
    }
    # The dependency dirs may be a venv where every plait distribution is installed editable: their
    # entry points show through, their code does not. Only the two this venv installs may load.
    clean["PLAIT_PLUGINS"] = "sdk,myenv"
    probe = subprocess.run(
        [python, "-c", "import plait"], capture_output=True, text=True, env=clean
    )
    assert probe.returncode != 0, "the fresh venv must not see plait before installing it"

    install = subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-e",
            str(REPO / "core"),
            "-e",
            str(REPO / "libs" / "testing"),
            "-e",
            str(REPO / "sdk"),
            "-e",
            str(package),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=clean,
    )
    assert install.returncode == 0, install.stderr[-3000:]

    listed = subprocess.run(
        [env_dir / "bin" / "plait", "env", "list"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean,
    )
    assert listed.returncode == 0 and "myenv" in listed.stdout and "ors" in listed.stdout, (
        listed.stderr
    )

    tests = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=package,
        capture_output=True,
        text=True,
        timeout=600,
        env=clean,
    )
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
    assert "3 passed" in tests.stdout
