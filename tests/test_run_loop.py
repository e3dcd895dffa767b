"""The run loop end to end in seconds, on the in-memory components of `plait_testing.fakes`: both
schedules learn, a resumed run trains what an uninterrupted one does, and every kind of failure
ends where DESIGN.md §9 says it does (one episode, a retry, or the run, named)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

from plait.api import (
    ConfigError,
    EngineError,
    EnvironmentError_,
    RendererError,
    load_config,
    read_jsonl,
)
from plait.components import build_components, validate_components
from plait.plugins import get_plugin_manager
from plait.run.loop import run_training
from plait.run.steps import all_or_none, sample_groups
from plait_testing.fakes import fake_model_dir

FAKES = {"PLAIT_PLUGIN_MODULES": "plait_testing.fakes"}


@pytest.fixture(autouse=True)
def fake_plugins(monkeypatch):
    """The fakes registered for this test only (the registry is process-wide)."""
    for name, value in FAKES.items():
        monkeypatch.setenv(name, value)
    get_plugin_manager.cache_clear()
    yield
    monkeypatch.undo()
    get_plugin_manager.cache_clear()


def config_file(tmp_path: Path, name: str = "fake", **sections: dict) -> Path:
    data = {
        "run": {"name": name, "out_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"name": str(fake_model_dir(tmp_path / "model"))},
        "trainer": {"engine": "fake", "learning_rate": 10.0},
        "inference": {"engine": "fake"},
        "renderer": {"name": "fake"},
        "sync": {"method": "fake"},
        "env": {"name": "fake.letters"},
        "rl": {"steps": 8, "groups_per_batch": 4, "group_size": 8, "max_tokens": 3},
        "eval": {"every": 4, "tasks": 8, "samples_per_task": 1},
        "checkpoint": {"every": 2},
        "metrics": {"sinks": ["jsonl"]},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(data))
    return path


def train(path: Path, *overrides: str, resume: bool = True) -> list[dict]:
    config = load_config(path, overrides)
    run_training(config, resume=resume)
    return read_jsonl(Path(config.run.out_dir) / config.run.name / "metrics.jsonl")


def steps_of(metrics: list[dict]) -> list[dict]:
    return [m for m in metrics if "reward/mean" in m]


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_both_schedules_learn_and_keep_every_batch_whole(tmp_path, schedule):
    metrics = steps_of(train(config_file(tmp_path), f"rl.schedule={schedule}", "rl.steps=12"))
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert all(m["progress/samples"] == 32 * m["step"] for m in metrics)
    first, last = metrics[0]["reward/mean"], metrics[-1]["reward/mean"]
    assert first < 0.2 and last > 0.8, (first, last)
    assert all(m["env/errors"] == 0 and m["engine/retries"] == 0 for m in metrics)


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_a_resumed_run_trains_what_an_uninterrupted_one_does(tmp_path, schedule):
    whole = config_file(tmp_path, "whole", rl={"schedule": schedule})
    halves = config_file(tmp_path, "halves", rl={"schedule": schedule})
    expected = steps_of(train(whole))
    train(halves, "rl.steps=4")
    resumed = steps_of(train(halves))  # steps 5..8 from the checkpoint of step 4
    assert [m["step"] for m in resumed] == list(range(1, 9))
    assert [m["progress/samples"] for m in resumed] == [m["progress/samples"] for m in expected]
    # async: what was in flight at the checkpoint is sampled again, by newer weights
    same = ("reward/mean", "optim/grad_norm", "eval/accuracy") if schedule == "sync" else ()
    for key in same:
        assert [m.get(key) for m in resumed] == [m.get(key) for m in expected], key


CRITIC = {"trainer": {"engine": "fake.critic", "learning_rate": 1.0}}
PPO = ("rl.advantage=gae", "rl.remove_constant_reward_groups=false")


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_ppo_with_a_critic_learns_and_the_critic_explains_more_of_the_returns(tmp_path, schedule):
    path = config_file(tmp_path, critic=CRITIC)
    metrics = steps_of(train(path, *PPO, f"rl.schedule={schedule}", "rl.steps=12"))
    first, last = metrics[0]["reward/mean"], metrics[-1]["reward/mean"]
    assert first < 0.2 and last > 0.8, (first, last)
    explained = [m["critic/explained_variance"] for m in metrics]
    assert explained[0] <= 0 < max(explained[1:]), explained  # a new critic values all at 0
    assert all(m["critic/value_loss"] > 0 for m in metrics)
    checkpoints = sorted((tmp_path / "runs" / "fake" / "checkpoints").glob("step_*"))
    assert (checkpoints[-1] / "critic" / "fake_critic.json").is_file()


def test_a_resumed_run_resumes_its_critic(tmp_path):
    whole = steps_of(train(config_file(tmp_path, "whole", critic=CRITIC), *PPO))
    halves = config_file(tmp_path, "halves", critic=CRITIC)
    train(halves, *PPO, "rl.steps=4")
    resumed = steps_of(train(halves, *PPO))  # steps 5..8 from the checkpoint of step 4
    for key in ("reward/mean", "critic/values_mean", "critic/explained_variance"):
        assert [m[key] for m in resumed] == [m[key] for m in whole], key


def test_a_critic_needs_a_value_head_and_a_run_of_one_policy(tmp_path):
    path = config_file(tmp_path, critic={"trainer": {"engine": "fake"}})
    with pytest.raises(
        ConfigError, match=r"critic\.trainer\.options: .* gives logprobs, not values"
    ):
        train(path, *PPO)
    policies = {"a": {"roles": []}, "b": {"roles": ["b"]}}
    path = config_file(tmp_path, "two", critic=CRITIC, policies=policies)
    with pytest.raises(ConfigError, match="critic: a critic serves a run of one policy"):
        validate_components(load_config(path))


def test_an_engine_error_is_retried_once_and_counted(tmp_path):
    metrics = steps_of(train(config_file(tmp_path), "inference.options.flaky_every=7"))
    assert len(metrics) == 8
    assert sum(m["engine/retries"] for m in metrics) > 0
    assert all(m["env/errors"] == 0 for m in metrics)


def test_an_engine_that_dies_stops_the_run_and_it_resumes_from_its_checkpoint(tmp_path):
    path = config_file(tmp_path)
    # evaluations of 8 episodes before steps 1 and 5, 32 episodes a step: it dies in step 5
    with pytest.raises(EngineError, match=r"FakeInferenceEngine failed twice.*exit code -9"):
        train(path, "inference.options.crash_after=150")
    run_dir = tmp_path / "runs" / "fake"
    assert [m["step"] for m in steps_of(read_jsonl(run_dir / "metrics.jsonl"))] == [1, 2, 3, 4]
    resumed = steps_of(train(path))  # the engine is back
    assert [m["step"] for m in resumed][-4:] == [5, 6, 7, 8]


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_a_renderer_that_raises_stops_the_run_named(tmp_path, schedule):
    with pytest.raises(RendererError, match="renderer FakeRenderer failed: KeyError"):
        train(config_file(tmp_path), "renderer.options.fail_parse=true", f"rl.schedule={schedule}")


def test_environment_failures_cost_their_episodes_until_they_pass_the_bound(tmp_path):
    path = config_file(tmp_path)
    metrics = steps_of(train(path, "env.options.fail_fraction=0.25"))  # 2 of 8 tasks fail
    assert len(metrics) == 8
    assert sum(m["env/errors"] for m in metrics) > 0
    assert all(m["engine/retries"] == 0 for m in metrics)
    with pytest.raises(
        EnvironmentError_, match=r"'fake\.letters' failed .* rl\.max_failed_fraction"
    ):
        train(path, "env.options.fail_fraction=0.75", resume=False)


def test_the_cli_exits_non_zero_naming_the_dead_engine(tmp_path):
    path = config_file(tmp_path)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait.cli",
            "run",
            str(path),
            "-s",
            "inference.options.crash_after=40",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **FAKES},
        timeout=300,
    )
    assert done.returncode != 0
    assert "FakeInferenceEngine failed twice" in done.stderr
    summary = tmp_path / "runs" / "fake" / "summary.json"
    assert not summary.exists() or json.loads(summary.read_text())["steps"] < 8


@pytest.mark.parametrize(
    "override, key, hint",
    [
        ("rl.advantage=grpoo", "rl.advantage", 'did you mean "grpo"'),
        ("off_policy.correction=tokens", "off_policy.correction", 'did you mean "token"'),
    ],
)
def test_algorithm_names_are_checked_against_the_registry(tmp_path, override, key, hint):
    with pytest.raises(ConfigError, match=hint) as info:
        validate_components(load_config(config_file(tmp_path), [override]))
    assert info.value.path == key


def test_a_failing_episode_cancels_the_others_of_its_batch():
    async def fails() -> None:
        await asyncio.sleep(0)
        raise EngineError("inference server crashed")

    async def main() -> list[bool]:
        others = [asyncio.ensure_future(asyncio.sleep(30)) for _ in range(3)]
        with pytest.raises(EngineError):
            await all_or_none([fails(), *others])
        return [task.cancelled() for task in others]

    assert asyncio.run(main()) == [True] * 3  # no episode samples on from a closing engine


# -- the KL reference on a frozen inference engine (rl.kl.reference = "inference") ------------

KL_ON_ENGINE = "rl.kl={coef=0.05, where='reward', reference='inference'}"


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_a_frozen_inference_engine_is_the_kl_reference_under_both_schedules(tmp_path, schedule):
    metrics = steps_of(train(config_file(tmp_path), KL_ON_ENGINE, f"rl.schedule={schedule}"))
    first, last = metrics[0]["reward/mean"], metrics[-1]["reward/mean"]
    assert first < 0.2 and last > 0.8, (first, last)
    scored = [m for m in metrics if "policy/kl_ref" in m]  # not steps without a varied group
    kl = [m["policy/kl_ref"] for m in scored]
    assert scored[0]["step"] == 1 and kl[0] == 0.0, "the first batch's sampler is the reference"
    # the policy learned and the reference did not follow: the weight sync never reached it
    assert kl[-1] > 1.0 and scored[-1]["data/kl_reward_penalty"] > 0, kl


def test_the_reference_scores_each_episode_as_it_ends_while_others_still_sample(tmp_path):
    """What overlaps sampling: an episode's reference forward starts when it ends, not when the
    batch does; episodes to evaluate are not scored."""
    config = load_config(config_file(tmp_path), [KL_ON_ENGINE])
    components = build_components(config, tmp_path)
    policy = components.policies[0]
    engine, reference = policy.engines[0], policy.reference
    assert reference is not None and reference is not engine
    events: list[str] = []
    sample, score = engine.sample, reference.compute_logprobs

    async def slow_sample(prompt, n, params):
        for _ in range(params.seed % 8):  # episode j takes j turns of the event loop
            await asyncio.sleep(0)
        response = await sample(prompt, n, params)
        events.append(f"sampled {params.seed % 8}")
        return response

    async def recorded_score(prompt):
        events.append("scored")
        return await score(prompt)

    engine.sample, reference.compute_logprobs = slow_sample, recorded_score

    def seed(_group: int, index: int) -> int:
        return 8 * 1000 + index

    groups = asyncio.run(sample_groups(config, components, "train", [0], 8, 1.0, seed, train=True))
    assert events.index("scored") < events.index("sampled 7"), events
    assert events.count("scored") == 8
    for turn in (turn for t in groups[0] for turn in t.turns):
        assert turn.ref_logprobs is not None
        assert len(turn.ref_logprobs) == len(turn.completion.tokens)
    events.clear()
    asyncio.run(sample_groups(config, components, "test", [0], 8, 1.0, seed))
    assert "scored" not in events, "held-out episodes train nothing and are not scored"


def test_a_failing_reference_engine_stops_the_sampling_named_as_the_reference(tmp_path):
    config = load_config(config_file(tmp_path), [KL_ON_ENGINE])
    components = build_components(config, tmp_path)

    async def dead(_prompt):
        raise EngineError("inference server crashed (exit code -9)")

    components.policies[0].reference.compute_logprobs = dead
    with pytest.raises(EngineError, match=r"KL reference engine \(FakeInferenceEngine.*code -9"):
        asyncio.run(
            sample_groups(config, components, "train", [0], 8, 1.0, lambda g, j: j, train=True)
        )
