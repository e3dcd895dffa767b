"""Run pieces that need no engines: task order, seeds, timing, rollout metrics."""

import attrs
import pytest

from plait.errors import PlaitError
from plait.run.report import rollout_metrics, union_seconds
from plait.run.state import EVAL_GREEDY, EVAL_SAMPLED, TaskSampler, sample_seed
from plait.trajectory import Trajectory, Turn
from plait.types import SampledSequence


def test_task_sampler_visits_every_task_once_per_epoch_and_is_deterministic():
    sampler = TaskSampler(10, seed=3)
    first_epoch = sampler.batch(0, 10)
    assert sorted(first_epoch) == list(range(10))
    assert sorted(sampler.batch(10, 10)) == list(range(10))
    assert TaskSampler(10, seed=3).batch(4, 3) == first_epoch[4:7]  # resumable from any position
    assert TaskSampler(10, seed=4).batch(0, 10) != first_epoch


def test_task_sampler_on_huge_procedural_splits():
    sampler = TaskSampler(10**12, seed=0)
    batch = sampler.batch(0, 1000)
    assert len(set(batch)) == 1000
    assert all(0 <= i < 10**12 for i in batch)


def test_task_sampler_rejects_empty_split():
    with pytest.raises(PlaitError, match="no tasks"):
        TaskSampler(0, 0)


def testunion_seconds_counts_overlaps_once():
    assert union_seconds([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4)
    assert union_seconds([]) == 0


def traj(correct, reward, error=None, tokens=2):
    turn = Turn([1, 2, 3], SampledSequence([5] * tokens, [-1.0] * tokens, "stop"))
    return Trajectory(task={}, turns=[turn], reward=reward, correct=correct, error=error)


def test_rollout_metrics():
    groups = [[traj(True, 1), traj(False, 0)], [traj(False, 0), traj(False, 0, error="boom")]]
    m = rollout_metrics(groups)
    assert m["reward/mean"] == pytest.approx(1 / 3)
    assert m["reward/pass@1"] == pytest.approx(1 / 3)
    assert m["env/errors"] == 1
    assert m["reward/k"] == 2
    assert m["reward/pass@k"] == 1.0  # only the group that kept all its samples counts
    assert m["data/response_tokens"] == 2


def test_rollout_metrics_average_the_environments_own_over_the_episodes_that_report_them():
    scored = [
        attrs.evolve(traj(True, 1), metrics={"env/reward/a": 1.0, "env/reward/b": 0.5}),
        attrs.evolve(traj(False, 0), metrics={"env/reward/a": 0.0}),
        attrs.evolve(traj(False, 0, error="boom"), metrics={"env/reward/a": 7.0}),
    ]
    m = rollout_metrics([scored])
    assert (m["env/reward/a"], m["env/reward/b"]) == (0.5, 0.5)


def test_sample_seeds_are_those_recorded_runs_used_and_distinct():
    """The sync schedule's seeds are unchanged from the runs whose curves the docs quote
    ((seed * 1_000_003 + step) * 100_003 + group * group_size + index), and evaluation streams
    never collide with training ones."""
    seed, group_size, groups = 7, 8, 16
    for step, group, index in [(0, 0, 0), (3, 5, 7), (59, 15, 7)]:
        recorded = (seed * 1_000_003 + step) * 100_003 + group * group_size + index
        assert sample_seed(seed, step, group * group_size + index) == recorded
    training = {
        sample_seed(seed, step, slot) for step in range(60) for slot in range(groups * group_size)
    }
    assert len(training) == 60 * groups * group_size
    evaluation = {
        sample_seed(seed, stream, slot)
        for stream in (EVAL_GREEDY, EVAL_SAMPLED)
        for slot in range(256)
    }
    assert len(evaluation) == 512 and not evaluation & training
    assert all(0 <= s < 1 << 62 for s in evaluation)
