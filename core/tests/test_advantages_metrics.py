import itertools
import math

import pytest

from plait.metrics import JsonlSink, merge_metrics, pass_at_k, read_jsonl


def brute_pass_at_k(outcomes, k):
    combos = list(itertools.combinations(outcomes, k))
    return sum(any(c) for c in combos) / len(combos)


@pytest.mark.parametrize(
    "n, c, k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (8, 3, 4), (5, 5, 3), (6, 2, 6)]
)
def test_pass_at_k_is_unbiased(n, c, k):
    outcomes = [True] * c + [False] * (n - c)
    assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k))


def test_merge_metrics_reductions():
    merged = merge_metrics(
        [
            ({"loss:sum": 1.0, "w:max": 2.0, "m:mean": 1.0, "x:min": 3.0}, 1),
            ({"loss:sum": 2.0, "w:max": 1.0, "m:mean": 4.0, "x:min": 1.0}, 3),
        ]
    )
    assert merged == {"loss:sum": 3.0, "w:max": 2.0, "m:mean": pytest.approx(3.25), "x:min": 1.0}


def test_jsonl_sink_round_trip_keeps_non_finite_values_visible(tmp_path):
    sink = JsonlSink(tmp_path)
    sink.log(1, {"reward/mean": 0.5, "optim/grad_norm": math.inf})
    sink.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "torn')  # a crash mid-write
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(records) == 1
    assert records[0]["reward/mean"] == 0.5 and records[0]["optim/grad_norm"] == "inf"
