"""The "group_median" estimator: against a reference written by hand, built through the registry
as a run builds it, and in a short `plait run` that finds it among the installed plugins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from plait.api import ADVANTAGE, LOSS, AdvantageBatch, ConfigError, build, get_registry, read_jsonl
from plait_testing.fakes import fake_model_dir

# Two groups of samples: (reward, action tokens) each; an odd and an even group size.
GROUPS = [[(1.0, 2), (0.0, 3), (0.0, 1)], [(0.2, 1), (0.9, 4), (0.4, 2), (0.1, 3)]]


def estimate(**options):
    batch = AdvantageBatch(
        [np.asarray([r for r, _ in g]) for g in GROUPS],
        [np.asarray([n for _, n in g]) for g in GROUPS],
    )
    return build(
        ADVANTAGE, "group_median", batch, options=options, options_path="rl.advantage_options"
    )


def median(xs):
    s = sorted(xs)
    middle = len(s) // 2
    return s[middle] if len(s) % 2 else (s[middle - 1] + s[middle]) / 2


@pytest.mark.parametrize("normalize", [False, True])
def test_each_token_gets_its_samples_reward_against_the_group_median(normalize):
    result = estimate(normalize=normalize)
    for got, group in zip(result, GROUPS, strict=True):
        rewards = [r for r, _ in group]
        expected = [r - median(rewards) for r in rewards]
        if normalize:
            scale = sum(abs(a) for a in expected) / len(expected) + 1e-6
            expected = [a / scale for a in expected]
        for tokens, advantage, (_, n) in zip(got, expected, group, strict=True):
            assert tokens.shape == (n,)
            assert np.allclose(tokens, advantage)


def test_bad_options_name_the_key():
    with pytest.raises(
        ConfigError,
        match=r'rl\.advantage_options\.normalise: unknown key \(did you mean "normalize"',
    ):
        estimate(normalise=True)


def plait_run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    """`plait run` of a few steps on plait-testing's in-memory components (seconds); its steps'
    metrics."""
    config = tmp_path / f"{name}.toml"
    config.write_text(
        f"""
[run]
name = "{name}"
out_dir = {json.dumps(str(tmp_path / "runs"))}
seed = 0
[model]
name = {json.dumps(str(fake_model_dir(tmp_path / "model")))}
[trainer]
engine = "fake"
learning_rate = 10.0
[inference]
engine = "fake"
[renderer]
name = "fake"
[sync]
method = "fake"
[env]
name = "fake.letters"
[rl]
steps = 3
groups_per_batch = 4
group_size = 8
max_tokens = 3
advantage = "group_median"
[eval]
every = 0
tasks = 4
samples_per_task = 1
[metrics]
sinks = ["jsonl"]
"""
    )
    args = [arg for override in overrides for arg in ("-s", override)]
    done = subprocess.run(
        [sys.executable, "-m", "plait.cli", "run", str(config), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PLAIT_PLUGIN_MODULES": "plait_testing.fakes"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    metrics = read_jsonl(tmp_path / "runs" / name / "metrics.jsonl")
    return [m for m in metrics if "reward/mean" in m]


def test_a_run_trains_with_it_from_the_installed_plugin(tmp_path):
    registry = get_registry()
    if "importance_sampling" not in registry.names(LOSS):
        pytest.skip("the run's loss name comes from plait-train: pip install -e libs/train")
    assert registry.get(ADVANTAGE, "group_median").plugin == "median_baseline"  # entry point
    plain = plait_run(tmp_path, "plain")
    normalized = plait_run(tmp_path, "normalized", "rl.advantage_options.normalize=true")
    assert [m["step"] for m in plain] == [1, 2, 3]
    assert all(m["data/groups_kept"] > 0 for m in plain)
    # the same samples at step 1 (same seeds, same weights), trained with other advantages
    assert plain[0]["reward/mean"] == normalized[0]["reward/mean"]
    assert plain[0]["optim/grad_norm"] != pytest.approx(normalized[0]["optim/grad_norm"])
    with pytest.raises(AssertionError, match=r"rl\.advantage_options\.scale: unknown key"):
        plait_run(tmp_path, "typo", "rl.advantage_options.scale=2")


def test_registers_through_the_hook_lazily():
    probe = (
        "import json, sys; from plait.plugins import get_registry; "
        "f = get_registry().get('advantage', 'group_median'); "
        "print(json.dumps([f.plugin, f.target, 'plait_median_baseline.estimator' in sys.modules]))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"),
        "PLAIT_PLUGINS": "none",
        "PLAIT_PLUGIN_MODULES": "plait_median_baseline.plugin",
    }
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [
        "plait_median_baseline.plugin",
        "plait_median_baseline.estimator:group_median",
        False,
    ]
