"""`plait scale RUN_DIR inference=N env=M`: what it writes for a run's pools, and what it
refuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w


def plait(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "plait.cli", *args], capture_output=True, text=True, timeout=120
    )
    done.output = done.stdout + done.stderr  # type: ignore[attr-defined]
    return done


def run_dir_with(tmp_path: Path, inference: dict, env: dict | None = None) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(
        tomli_w.dumps({"inference": inference, "env": env or {"name": "math.arith"}})
    )
    return run_dir


def test_scale_writes_what_the_runs_pool_reads(tmp_path: Path) -> None:
    scale_file = tmp_path / "run" / "scale.json"
    run_dir = run_dir_with(
        tmp_path, {"engine": "pool", "options": {"scale_file": str(scale_file), "poll_s": 2.0}}
    )
    done = plait("scale", str(run_dir), "inference=4")
    assert done.returncode == 0, done.output
    assert json.loads(scale_file.read_text()) == {"replicas": 4}
    assert "for 4" in done.output and "every 2 s" in done.output
    assert plait("scale", str(run_dir), "inference=1").returncode == 0
    assert json.loads(scale_file.read_text()) == {"replicas": 1}
    assert sorted(p.name for p in scale_file.parent.iterdir()) == [
        "config.toml",
        "scale.json",
    ]  # no partial file left


def test_scale_sizes_both_pools_of_a_run_at_once(tmp_path: Path) -> None:
    engines, envs = tmp_path / "engines.json", tmp_path / "envs.json"
    run_dir = run_dir_with(
        tmp_path,
        {"engine": "pool", "options": {"scale_file": str(engines)}},
        {"name": "pool", "options": {"scale_file": str(envs)}},
    )
    done = plait("scale", str(run_dir), "inference=2", "env=5")
    assert done.returncode == 0, done.output
    assert json.loads(engines.read_text()) == {"replicas": 2} and json.loads(envs.read_text()) == {
        "replicas": 5
    }


@pytest.mark.parametrize(
    ("inference", "args", "said"),
    [
        ({"engine": "torch"}, ["inference=2"], "only a pool scales"),
        (
            {"engine": "pool", "options": {"scale_file": "x.json"}},
            ["env=2"],
            "env.name = 'math.arith'",
        ),
        ({"engine": "pool", "options": {}}, ["inference=2"], "reads no scale file"),
        (
            {"engine": "pool", "options": {"scale_file": "x.json"}},
            ["trainer=2"],
            "inference=N or env=N",
        ),
        (
            {"engine": "pool", "options": {"scale_file": "x.json"}},
            ["inference=two"],
            "inference=N or env=N",
        ),
        (
            {"engine": "pool", "options": {"scale_file": "x.json"}},
            ["inference=0"],
            "at least one member",
        ),
    ],
)
def test_scale_refuses_what_it_cannot_do_and_says_why(
    tmp_path: Path, inference: dict, args: list[str], said: str
) -> None:
    run_dir = run_dir_with(tmp_path, inference)
    done = plait("scale", str(run_dir), *args)
    assert done.returncode != 0 and said in done.output, done.output
    assert not (tmp_path / "x.json").exists()


def test_scale_refuses_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    done = plait("scale", str(tmp_path), "inference=2")
    assert done.returncode != 0 and "not a run's directory" in done.output
