"""The dashboard: rendered from metrics.jsonl by `plait plot` and by the sink when a run ends."""

import io
import json
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from plait.api import PlaitError
from plait.cli import cli
from plait.plugins import get_plugin_manager, get_registry
from plait_sinks.dashboard import DashboardOptions, DashboardSink
from plait_sinks.plot import plot_run, policy_names

PNG = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, records):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def run_records(steps=5, policies=()):
    records = [{"step": 0, "eval/accuracy": 0.1}]
    for s in range(1, steps + 1):
        record = {
            "step": s,
            "reward/mean": s / 10,
            "policy/entropy": 1 - s / 20,
            "optim/grad_norm": 1.0,
            "time/rollout": 2.0,
            "time/train": 1.0,
            "time/sync": 0.1,
            "time/total": 3.1,
        }
        record.update({f"reward/mean@{p}": s / (10 + i) for i, p in enumerate(policies)})
        records.append(record)
    records.append({"step": steps, "eval/accuracy": 0.6})
    return records


def test_dashboard_renders_from_metrics(tmp_path):
    write_metrics(tmp_path, run_records())
    out = plot_run(tmp_path)
    assert out.read_bytes()[:8] == PNG
    assert out.stat().st_size > 20_000


def test_a_run_with_several_policies_gets_a_line_per_policy(tmp_path):
    records = run_records(policies=("solver", "proposer"))
    (tmp_path / "config.toml").write_text(
        '[policies.solver]\nroles = ["solver"]\n[policies.proposer]\nroles = ["proposer"]\n'
    )
    assert policy_names(tmp_path) == ["solver", "proposer"]
    write_metrics(tmp_path, records)
    single = tmp_path / "single"
    single.mkdir()
    write_metrics(single, run_records())
    # two more lines (and their legend entries) in the reward panel make a different picture
    assert plot_run(tmp_path).read_bytes() != plot_run(single).read_bytes()


def test_dashboard_of_a_directory_without_metrics_says_so(tmp_path):
    with pytest.raises(PlaitError, match=r"no metrics\.jsonl"):
        plot_run(tmp_path)


def test_the_sink_renders_when_the_run_ends_and_every_n_steps(tmp_path):
    sink = DashboardSink(tmp_path, options=DashboardOptions(every=2))
    records = run_records(steps=3)
    write_metrics(tmp_path, records[:2])
    sink.log(1, records[1])
    assert not (tmp_path / "dashboard.png").exists()
    write_metrics(tmp_path, records[:3])
    sink.log(2, records[2])
    first = (tmp_path / "dashboard.png").read_bytes()
    write_metrics(tmp_path, records)
    sink.log(3, records[3])
    sink.close()
    assert (tmp_path / "dashboard.png").read_bytes() not in (b"", first)


def test_the_sink_without_metrics_jsonl_warns_instead_of_failing_the_run(tmp_path):
    sink = DashboardSink(tmp_path)
    sink.log(1, {"reward/mean": 0.5})
    sink.close()
    assert not (tmp_path / "dashboard.png").exists()


def test_the_plugin_registers_the_sink_and_the_plot_command(tmp_path):
    assert "dashboard" in get_registry().names("metric_sink")
    write_metrics(tmp_path, run_records())
    get_plugin_manager().add_commands(cli)
    result = CliRunner().invoke(cli, ["plot", str(tmp_path), "-o", str(tmp_path / "d.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "d.png").read_bytes()[:8] == PNG


def test_tensorboard_sink_writes_event_files_without_torch(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # as where torch is not installed: importing it fails
        from plait.plugins import build
        sink = build("metric_sink", "tensorboard", {str(tmp_path)!r})
        sink.log(1, {{"reward/mean": 0.5, "time/total": 2.0}})
        sink.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_the_console_draws_the_runs_progress_on_a_terminal(tmp_path, monkeypatch):
    from rich.console import Console

    import plait_sinks.console as console_sink

    screen = Console(file=io.StringIO(), force_terminal=True, color_system=None, width=120)
    monkeypatch.setattr(console_sink, "console", screen)
    (tmp_path / "config.toml").write_text('[run]\nname = "demo"\n[rl]\nsteps = 3\n')
    sink = console_sink.ConsoleSink(tmp_path)
    sink.phase(0, "eval")
    sink.log(0, {"eval/accuracy": 0.25})
    for step in (1, 2, 3):
        sink.phase(step - 1, "rollout/train")
        sink.log(step, {"reward/mean": step / 4})
    sink.close()
    shown = screen.file.getvalue()
    assert "step    3  mean=0.75" in shown  # the step's line, above the bar
    assert "demo" in shown and "3/3" in shown and "eval 0.250, reward 0.750" in shown
