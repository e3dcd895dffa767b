"""`plait eval` on plait-testing's in-memory components (`plait_testing.fakes`): its numbers are
those of its rows, pass@k is the unbiased estimator, a run's checkpoint is evaluated with the
trained weights, and each mistake ends in one error line that names the fix."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import pytest
import tomli_w
from click.testing import CliRunner

from plait.api import load_config, pass_at_k, read_jsonl
from plait.plugins import get_plugin_manager
from plait_sdk.evaluate import EvalSettings, run_eval, summarize
from plait_sdk.plugin import plait_register_commands
from plait_testing.fakes import fake_model_dir


@pytest.fixture(autouse=True)
def fake_plugins(monkeypatch):
    """The fakes registered for this test only (the registry is process-wide)."""
    monkeypatch.setenv("PLAIT_PLUGIN_MODULES", "plait_testing.fakes")
    get_plugin_manager.cache_clear()
    yield
    monkeypatch.undo()
    get_plugin_manager.cache_clear()


def config_file(tmp_path: Path, **sections: dict) -> Path:
    data = {
        "run": {"name": "fake", "out_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"name": str(fake_model_dir(tmp_path / "model"))},
        "trainer": {"engine": "fake", "learning_rate": 10.0},
        "inference": {"engine": "fake"},
        "renderer": {"name": "fake"},
        "sync": {"method": "fake"},
        "env": {"name": "fake.letters"},
        "rl": {"steps": 2, "groups_per_batch": 4, "group_size": 8, "max_tokens": 3},
        "eval": {"every": 0, "tasks": 8, "samples_per_task": 1},
        "checkpoint": {"every": 1},
        "metrics": {"sinks": ["jsonl"]},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    path = tmp_path / "fake.toml"
    path.write_text(tomli_w.dumps(data))
    return path


def invoke(*args: str) -> click.testing.Result:
    @click.group()
    def cli() -> None:
        pass

    plait_register_commands(cli)
    return CliRunner().invoke(cli, ["eval", *args], catch_exceptions=False)


def hand_summary(rows: list[dict], k: int) -> dict[str, float]:
    n = len(rows)
    out = {
        "reward": sum(r["rewards"][0] for r in rows) / n,
        "pass@1": sum(r["correct"][0] for r in rows) / n,
    }
    if k > 1:
        out[f"pass@{k}"] = sum(pass_at_k(k, sum(r["correct"][1:]), k) for r in rows) / n
    return out


def test_the_numbers_are_those_of_the_rows(tmp_path):
    rows_file = tmp_path / "out" / "rows.jsonl"
    done = invoke(
        str(config_file(tmp_path)),
        "--tasks",
        "6",
        "--samples",
        "4",
        "--temperature",
        "1.5",
        "--output",
        str(rows_file),
    )
    assert done.exit_code == 0, done.output
    rows = read_jsonl(rows_file)
    assert [r["index"] for r in rows] == list(range(6))
    assert all(len(r[key]) == 5 for r in rows for key in ("rewards", "correct", "completions"))
    assert all(
        isinstance(c, list) and all(isinstance(s, str) for s in c) for c in rows[0]["completions"]
    )
    hand = hand_summary(rows, 4)
    # samples at T=1.5 on untrained logits: some right, some wrong, so pass@4 is no constant
    assert 0 < sum(sum(r["correct"][1:]) for r in rows) < 24
    line = done.output.strip().splitlines()[-1]
    assert line == (
        f"eval fake.letters [test]: 6 tasks, mean reward {hand['reward']:.4f}, "
        f"pass@1 {hand['pass@1']:.4f} (greedy), pass@4 {hand['pass@4']:.4f} "
        f"(4 samples at T=1.5); rows in {rows_file}"
    )


def test_pass_at_k_is_the_unbiased_estimator_and_leaves_out_failed_samples():
    rows = [
        {"rewards": [1.0, 0, 1, 0, 0, 1], "correct": [True, False, True, False, False, True]},
        {"rewards": [0.0, 0, 0, 0, 0, 0], "correct": [False] * 6},
        {"rewards": [0.5, 1, 1, 1, 1, 1], "correct": [False, True, True, True, True, False]},
    ]
    for r in rows:
        r["errors"] = [None] * 6
    summary = summarize(rows, 5)
    # 1 - C(n-c, k) / C(n, k) with n = k = 5: 1 when any sample is right
    assert summary["pass@5"] == pytest.approx((1 + 0 + 1) / 3)
    assert summary["pass@1"] == pytest.approx(1 / 3)
    assert summary["reward"] == pytest.approx(1.5 / 3)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - (3 * 2) / (5 * 4))
    rows[0]["errors"][3] = "environment failed"  # that task has 4 of 5 samples: left out
    summary = summarize(rows, 5)
    assert summary["pass@5"] == pytest.approx(1 / 2) and summary["errors"] == 1


def test_a_checkpoint_is_evaluated_with_its_trained_weights(tmp_path):
    from plait.run.loop import run_training

    path = config_file(tmp_path)
    run_training(load_config(path), resume=False)
    run_dir = tmp_path / "runs" / "fake"
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert [c.name for c in checkpoints] == ["step_000001", "step_000002"]

    settings = EvalSettings(tasks=4)
    _, base = run_eval(path, settings)
    _, first = run_eval(checkpoints[0], settings)
    _, last = run_eval(run_dir, settings)  # a run directory: its newest checkpoint
    _, named = run_eval(checkpoints[-1], settings)
    assert base["pass@1"] == 0.0  # untrained logits: greedy never answers "c"
    assert last["pass@1"] == 1.0 and named == last
    assert first["tasks"] == 4.0
    # the rest of the run's config is the run's own: its env, its model
    assert load_config(run_dir / "config.toml").env.name == "fake.letters"


def test_flags_override_the_env_and_its_options(tmp_path):
    rows_file = tmp_path / "rows.jsonl"
    config, summary = run_eval(
        config_file(tmp_path, env={"name": "fake.letters", "options": {"tasks": 8}}),
        EvalSettings(env="fake.letters", env_options=("tasks=3",), split="train"),
        rows_file,
    )
    assert config.env.options == {"tasks": 3} and config.env.eval_split == "train"
    assert summary["tasks"] == 3 and "pass@2" not in summary
    assert [json.loads(line)["task"] for line in rows_file.read_text().splitlines()] == [
        {"index": i, "split": "train"} for i in range(3)
    ]


@pytest.mark.parametrize(
    ("args", "error", "fix"),
    [
        (["--env", "no.such.env"], "no.such.env", "fix:"),
        (["--env-option", "tasks"], "--env-option 'tasks' is not KEY=VALUE", "--env-option KEY"),
        (["--env-option", "colour=red"], "env.options.colour", "allowed keys: tasks"),
        (["--split", "dev"], "has no split 'dev' (it has train, test)", "--split"),
    ],
)
def test_config_errors_are_one_line_with_the_fix(tmp_path, monkeypatch, capsys, args, error, fix):
    check_error(monkeypatch, capsys, [str(config_file(tmp_path)), *args], error, fix)


def test_checkpoint_errors_are_one_line_with_the_fix(tmp_path, monkeypatch, capsys):
    check_error(
        monkeypatch, capsys, [str(tmp_path / "nope")], "no run config or checkpoint", "fix:"
    )
    run_dir = tmp_path / "runs" / "r"
    (run_dir / "checkpoints").mkdir(parents=True)
    check_error(monkeypatch, capsys, [str(run_dir)], "has no checkpoint", "fix:")
    step = run_dir / "checkpoints" / "step_000001"
    step.mkdir()
    (step / "controller.json").write_text("{}")
    check_error(monkeypatch, capsys, [str(step)], "has no run config", "fix:")
    check_error(monkeypatch, capsys, [str(tmp_path)], "neither a run directory", "fix:")


def test_a_bad_flag_value_is_refused_by_the_command_line(tmp_path):
    refused = CliRunner().invoke(_cli(), ["eval", str(config_file(tmp_path)), "--samples", "0"])
    assert refused.exit_code == 2 and "'--samples'" in refused.output


def _cli() -> click.Group:
    @click.group()
    def cli() -> None:
        pass

    plait_register_commands(cli)
    return cli


def check_error(monkeypatch, capsys, args: list[str], error: str, fix: str) -> None:
    from plait.cli import main

    monkeypatch.setattr(sys, "argv", ["plait", "eval", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith("error: ") and error in first, err
    assert fix in err and "Traceback" not in err
