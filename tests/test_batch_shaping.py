"""The batch between sampling and training (issue 30, item 3): the config of how token losses are
weighed (`rl.loss_aggregation`), of samples a length limit cut (`rl.overlong`,
`rl.overlong_buffer`) and of DAPO's dynamic sampling (`rl.dynamic_sampling`,
`rl.max_sampling_rounds`), whose errors name their key; and dynamic sampling on the real loop,
with the in-memory components of `plait_testing.fakes`, on a task set where most prompts reward
every answer alike. What the batch preparer makes of the groups is tested with it
(libs/algorithms/tests/test_batch.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomli_w

from plait.api import ConfigError, load_config, read_jsonl
from plait.plugins import get_plugin_manager
from plait.run.loop import run_training
from plait_testing.fakes import fake_model_dir

# -- config errors name their key ------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, path, message",
    [
        (["rl.loss_aggregation=seq_mean"], "rl.loss_aggregation", "'sequence_mean'"),
        (["rl.overlong=truncate"], "rl.overlong", "'mask'"),
        (["rl.overlong=penalty"], "rl", r"overlong_buffer must be in \[1, max_tokens = 64\]"),
        (
            ["rl.overlong=penalty", "rl.overlong_buffer=65"],
            "rl",
            "overlong_buffer must be in",
        ),
        (["rl.overlong_buffer=-1"], "rl", "overlong_buffer must be >= 0"),
        (["rl.max_sampling_rounds=0"], "rl", "max_sampling_rounds must be > 0"),
        (
            ["rl.dynamic_sampling=true", "rl.schedule=async"],
            "rl",
            "dynamic_sampling needs schedule = 'sync'.*remove_constant_reward_groups",
        ),
    ],
)
def test_config_errors_name_the_key(overrides, path, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, overrides)
    assert info.value.path == path


# -- dynamic sampling, on the real loop ------------------------------------------------------


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setenv("PLAIT_PLUGIN_MODULES", "plait_testing.fakes")
    get_plugin_manager.cache_clear()
    yield
    monkeypatch.undo()
    get_plugin_manager.cache_clear()


def run(tmp_path: Path, name: str, **rl) -> tuple[list[dict], list[dict]]:
    """A fake run of 4 prompts a step, 8 samples each, on 16 tasks of which only every other
    one rewards a right answer; its step metrics and ledger."""
    config = {
        "run": {"name": name, "out_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"name": str(fake_model_dir(tmp_path / "model"))},
        "trainer": {"engine": "fake", "learning_rate": 1.0},
        "inference": {"engine": "fake"},
        "renderer": {"name": "fake"},
        "sync": {"method": "fake"},
        "env": {"name": "fake.letters", "options": {"tasks": 16, "signal_every": 2}},
        "rl": {"steps": 6, "groups_per_batch": 4, "group_size": 8, "max_tokens": 3, **rl},
        "eval": {"every": 0, "tasks": 4, "samples_per_task": 1},
        "checkpoint": {"every": 3},
        "metrics": {"sinks": ["jsonl"]},
    }
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(config))
    run_training(load_config(path))
    run_dir = tmp_path / "runs" / name
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in m]
    ledger = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    return steps, ledger


def check_sampling(steps, ledger, cap):
    positions = [s[0] for record in ledger for s in record["samples"][::8]]
    # refilled from fresh prompts: the task order's next positions, none sampled twice
    assert positions == list(range(len(positions)))
    for m, record in zip(steps, ledger, strict=True):
        sampled = len(record["samples"]) // 8
        assert sampled == 4 + m["data/resampled_groups"]
        assert m["data/groups_kept"] + m["data/groups_constant"] == sampled
        assert 1 <= m["data/sampling_rounds"] <= cap
        assert (m["data/sampling_rounds"] > 1) == (m["data/resampled_groups"] > 0)
        if m["data/sampling_capped"]:
            assert m["data/sampling_rounds"] == cap and m["data/groups_kept"] < 4
        else:  # the trained batch is exactly groups_per_batch groups
            assert m["data/groups_kept"] == 4


def test_dynamic_sampling_keeps_every_batch_whole_from_fresh_prompts(tmp_path, fakes):
    steps, ledger = run(tmp_path, "dynamic", dynamic_sampling=True, max_sampling_rounds=40)
    assert [m["step"] for m in steps] == list(range(1, 7))
    check_sampling(steps, ledger, cap=40)
    assert not any(m["data/sampling_capped"] for m in steps)
    assert sum(m["data/resampled_groups"] for m in steps) > 0
    plain, _ = run(tmp_path, "plain")  # without it most groups train on nothing
    assert all(m["data/groups_kept"] < 4 for m in plain)
    assert "data/sampling_rounds" not in plain[0]


def test_dynamic_sampling_stops_at_its_cap_and_says_so(tmp_path, fakes):
    steps, ledger = run(tmp_path, "capped", dynamic_sampling=True, max_sampling_rounds=2)
    check_sampling(steps, ledger, cap=2)
    assert any(m["data/sampling_capped"] for m in steps)


def test_a_resumed_dynamic_run_trains_what_an_uninterrupted_one_does(tmp_path, fakes):
    whole = run(tmp_path, "whole", dynamic_sampling=True, max_sampling_rounds=40)
    run(tmp_path, "halves", dynamic_sampling=True, max_sampling_rounds=40, steps=3)
    resumed = run(tmp_path, "halves", dynamic_sampling=True, max_sampling_rounds=40)

    def trained(ledger):  # position, index, task, tokens: all but the sampling process
        return [[s[:3] + s[4:] for s in record["samples"]] for record in ledger]

    assert trained(resumed[1]) == trained(whole[1])
    keys = ("reward/mean", "data/resampled_groups", "optim/grad_norm")
    assert [[m[k] for k in keys] for m in resumed[0]] == [[m[k] for k in keys] for m in whole[0]]
