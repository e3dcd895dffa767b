import numpy as np

from plait.trajectory import Trajectory, Turn, merge_turns, trajectory_to_datums
from plait.types import SampledSequence


def seq(tokens, version=0):
    return SampledSequence(tokens, [-0.5 - 0.1 * i for i in range(len(tokens))], "stop", weight_version=version)


def test_single_turn_datum_alignment():
    traj = Trajectory(task={}, turns=[Turn([1, 2, 3], seq([7, 8]))], reward=1.0)
    (datum,) = trajectory_to_datums(traj, advantage=2.0)
    assert datum.model_input.to_ints() == [1, 2, 3, 7]
    inputs = {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()}
    assert inputs["target_tokens"].tolist() == [2, 3, 7, 8]
    assert inputs["mask"].tolist() == [0, 0, 1, 1]
    assert np.allclose(inputs["advantages"], [0, 0, 2, 2])
    assert np.allclose(inputs["logprobs"], [0, 0, -0.5, -0.6])


def test_turns_that_extend_the_prefix_merge_into_one_datum():
    t1 = Turn([1, 2], seq([3, 4]))
    t2 = Turn([1, 2, 3, 4, 9, 9], seq([5], version=1))  # observation 9 9 appended
    (segment,) = merge_turns([t1, t2])
    assert segment.tokens == [1, 2, 3, 4, 9, 9, 5]
    assert segment.sampled == [False, False, True, True, False, False, True]
    assert segment.versions == [-1, -1, 0, 0, -1, -1, 1]


def test_a_rewritten_history_starts_a_new_datum():
    t1 = Turn([1, 2], seq([3, 4]))
    t2 = Turn([1, 2, 4, 9], seq([5]))  # the history was re-rendered differently
    segments = merge_turns([t1, t2])
    assert [s.tokens for s in segments] == [[1, 2, 3, 4], [1, 2, 4, 9, 5]]
    traj = Trajectory(task={}, turns=[t1, t2])
    assert len(trajectory_to_datums(traj, 1.0)) == 2


def test_failed_episode_trains_on_nothing():
    traj = Trajectory(task={}, turns=[Turn([1], seq([2]))], error="RuntimeError: boom")
    assert trajectory_to_datums(traj, 1.0) == []
