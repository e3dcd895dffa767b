import attrs
import numpy as np
import pytest

from plait.errors import DataError
from plait.trajectory import Trajectory, Turn
from plait.types import SampledSequence, TensorData
from plait_algorithms.datums import merge_turns, trajectory_to_datums


def seq(tokens, version=0):
    return SampledSequence(
        tokens, [-0.5 - 0.1 * i for i in range(len(tokens))], "stop", weight_version=version
    )


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


def routed(rows, layers=2, top_k=2, offset=0):
    """Distinct, recognisable routing rows: row i holds ids offset + i (mod 250)."""
    ids = (np.arange(rows)[:, None, None] + offset + np.zeros((1, layers, top_k), dtype=int)) % 250
    return TensorData.compact(ids)


def test_routing_travels_into_the_datum_from_the_last_turn_of_a_segment():
    t1 = Turn([1, 2], attrs.evolve(seq([3, 4]), routed_experts=routed(3)))
    t2 = Turn([1, 2, 3, 4, 9, 9], attrs.evolve(seq([5]), routed_experts=routed(6, offset=100)))
    (datum,) = trajectory_to_datums(Trajectory(task={}, turns=[t1, t2]), 1.0)
    routing = datum.loss_fn_inputs["routed_experts"]
    assert routing.dtype == "uint8" and routing.shape == (6, 2, 2) == (
        datum.model_input.length,
        2,
        2,
    )
    assert routing.to_numpy()[:, 0, 0].tolist() == list(
        range(100, 106)
    )  # the second turn's prefill
    # A turn whose routing does not cover its sequence (or none) leaves the datum without routing.
    short = Turn([1, 2], attrs.evolve(seq([3, 4]), routed_experts=routed(2)))
    (datum,) = trajectory_to_datums(Trajectory(task={}, turns=[short]), 1.0)
    assert "routed_experts" not in datum.loss_fn_inputs


def test_reference_logprobs_follow_their_tokens_through_merged_turns():
    t1 = attrs.evolve(Turn([1, 2], seq([3, 4])), ref_logprobs=(-1.0, -2.0))
    t2 = attrs.evolve(Turn([1, 2, 3, 4, 9], seq([5])), ref_logprobs=(-3.0,))
    (datum,) = trajectory_to_datums(Trajectory(task={}, turns=[t1, t2]), advantage=1.0)
    inputs = {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()}
    assert inputs["target_tokens"].tolist() == [2, 3, 4, 9, 5]
    assert inputs["ref_logprobs"].tolist() == [0.0, -1.0, -2.0, 0.0, -3.0]


def test_a_turn_without_reference_logprobs_leaves_them_out_of_its_datum():
    t1 = attrs.evolve(Turn([1, 2], seq([3, 4])), ref_logprobs=(-1.0, -2.0))
    t2 = Turn([1, 2, 3, 4, 9], seq([5]))
    (datum,) = trajectory_to_datums(Trajectory(task={}, turns=[t1, t2]), advantage=1.0)
    assert "ref_logprobs" not in datum.loss_fn_inputs


def test_reference_logprobs_that_miscount_the_completion_are_named():
    bad = attrs.evolve(Turn([1, 2], seq([3, 4])), ref_logprobs=(-1.0,))
    with pytest.raises(DataError, match="carries 1 reference logprobs for its 2 completion"):
        trajectory_to_datums(Trajectory(task={}, turns=[bad]), advantage=1.0)
