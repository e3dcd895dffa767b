import attrs
import numpy as np

from plait.serde import from_json, to_json
from plait.trajectory import Trajectory, Turn
from plait.types import SampledSequence, TensorData


def seq(tokens, version=0):
    return SampledSequence(
        tokens, [-0.5 - 0.1 * i for i in range(len(tokens))], "stop", weight_version=version
    )


def routed(rows, layers=2, top_k=2, offset=0):
    """Distinct, recognisable routing rows: row i holds ids offset + i (mod 250)."""
    ids = (np.arange(rows)[:, None, None] + offset + np.zeros((1, layers, top_k), dtype=int)) % 250
    return TensorData.compact(ids)


def test_routing_survives_json_and_the_ledger_digest_sees_it():
    from plait.run.state import TrainedSample

    sequence = attrs.evolve(seq([3, 4]), routed_experts=routed(3))
    trajectory = Trajectory(task={}, turns=[Turn([1, 2], sequence)])
    again = from_json(Trajectory, to_json(trajectory))
    assert (
        again.turns[0].completion.routed_experts == sequence.routed_experts
    )  # dtype and shape kept
    entry = TrainedSample(0, 0, 0, 1, trajectory).ledger_entry()
    other = attrs.evolve(
        trajectory, turns=[Turn([1, 2], attrs.evolve(sequence, routed_experts=routed(3, offset=1)))]
    )
    assert TrainedSample(0, 0, 0, 1, other).ledger_entry()[-1] != entry[-1]
