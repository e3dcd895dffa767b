"""The test-sized example on a real two-node Ray cluster (two Ray nodes on this machine, on
loopback): its trainer service on the node with the `trainer_pool` resource, its inference
service on the node with `inference_pool`, the controller in `plait run` connected to the
cluster. The config differs from the in-process run (tests/test_learning_arith_tiny.py) and the
HTTP-services run (tests/test_services.py) only in where the components live."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("plait_remote")
pytest.importorskip("ray")


@pytest.mark.timeout(2400)  # the first run also builds tiny-qwen3-arith (minutes)
def test_arith_tiny_learns_with_its_trainer_and_inference_on_two_ray_nodes(run_arith_tiny) -> None:
    from plait_testing.ray import local_cluster

    with local_cluster([{"trainer_pool": 1}, {"inference_pool": 1}]) as cluster:
        import ray

        node_of = {
            resource: node["NodeID"][:12]
            for node in ray.nodes()
            for resource in node["Resources"]
            if resource.endswith("_pool")
        }

        def on_ray(pool: str) -> str:
            return (
                f'{{engine="torch", ray={{address="{cluster.address}", resources={{{pool}=1}}}}}}'
            )

        run = run_arith_tiny(
            "trainer.engine=remote",
            f"trainer.options={on_ray('trainer_pool')}",
            "inference.engine=remote",
            f"inference.options={on_ray('inference_pool')}",
        )
    run.assert_learned()
    placed = dict(
        (service, node)
        for node, service in re.findall(
            r"service started on Ray.*? node=(\w+) server='plait (\w+) service'", run.output
        )
    )
    assert placed == {"trainer": node_of["trainer_pool"], "inference": node_of["inference_pool"]}, (
        run.output[-3000:]
    )
