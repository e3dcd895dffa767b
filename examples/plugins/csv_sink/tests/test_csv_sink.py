"""The "csv" sink built the way a run builds it (`plait.plugins.build("metric_sink", ...)`)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.api import ConfigError, MetricSink, build

SRC = Path(__file__).resolve().parents[1] / "src"


def read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_writes_one_row_per_step_and_widens_for_new_metrics(tmp_path: Path) -> None:
    sink = build("metric_sink", "csv", tmp_path, options={})
    assert isinstance(sink, MetricSink)
    sink.log(1, {"reward/mean": 0.25, "time/total": 1.5})
    sink.log(2, {"reward/mean": 0.5, "time/total": 1.25, "eval/accuracy": 0.75})
    sink.log(3, {"reward/mean": float("nan")})
    sink.close()
    header, rows = read(tmp_path / "metrics.csv")
    assert header == ["step", "wall_time", "reward/mean", "time/total", "eval/accuracy"]
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert rows[0]["eval/accuracy"] == "" and rows[1]["eval/accuracy"] == "0.75"
    assert rows[2]["reward/mean"] == "nan" and rows[2]["time/total"] == ""
    assert all(float(r["wall_time"]) > 0 for r in rows)
    assert not list(tmp_path.glob("*.tmp"))


def test_a_resumed_run_appends_with_the_columns_it_finds(tmp_path: Path) -> None:
    first = build("metric_sink", "csv", tmp_path, options={})
    first.log(1, {"b": 2.0, "a": 1.0})
    first.close()
    again = build("metric_sink", "csv", tmp_path, options={})
    again.log(2, {"a": 3.0, "c": 4.0})
    header, rows = read(tmp_path / "metrics.csv")
    assert header == ["step", "wall_time", "b", "a", "c"]
    assert [(r["step"], r["a"], r["b"], r["c"]) for r in rows] == [
        ("1", "1.0", "2.0", ""),
        ("2", "3.0", "", "4.0"),
    ]


def test_options_choose_the_file_and_the_metrics(tmp_path: Path) -> None:
    sink = build(
        "metric_sink",
        "csv",
        tmp_path / "run",
        options={"filename": "rl.csv", "prefixes": ["reward/"]},
    )
    sink.log(0, {"reward/mean": 1.0, "time/total": 2.0})
    header, _ = read(tmp_path / "run" / "rl.csv")
    assert header == ["step", "wall_time", "reward/mean"]


def test_bad_options_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r'metrics\.options\.csv\.prefix: unknown key \(did you mean "prefixes"\?\)',
    ):
        build(
            "metric_sink",
            "csv",
            tmp_path,
            options={"prefix": ["x"]},
            options_path="metrics.options.csv",
        )
    with pytest.raises(ConfigError, match=r"metrics\.options\.csv\.prefixes: expected a list"):
        build(
            "metric_sink",
            "csv",
            tmp_path,
            options={"prefixes": "reward/"},
            options_path="metrics.options.csv",
        )


def test_registers_through_the_hook_lazily() -> None:
    probe = (
        "import json, sys; from plait.plugins import get_registry; "
        "f = get_registry().get('metric_sink', 'csv'); "
        "print(json.dumps([f.plugin, f.target, 'plait_csv_sink.sink' in sys.modules]))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "PLAIT_PLUGINS": "none",
        "PLAIT_PLUGIN_MODULES": "plait_csv_sink.plugin",
    }
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [
        "plait_csv_sink.plugin",
        "plait_csv_sink.sink:CsvSink",
        False,
    ]
