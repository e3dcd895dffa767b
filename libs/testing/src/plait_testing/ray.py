"""A real Ray cluster of several nodes on this machine, for tests of components placed on Ray.

Every node reports 127.0.0.1 (tests keep their traffic on loopback): Ray otherwise advertises the
machine's outward address, and only its Python `Cluster` API starts a second node on one machine
(`ray start` refuses it). Nodes are told apart by custom resources.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Set where a node starts and in every process that connects (`plait run` included)."""


@contextlib.contextmanager
def local_cluster(nodes: Sequence[Mapping[str, float]], *, num_cpus: int = 1) -> Iterator[Any]:
    """Nodes with `num_cpus` CPUs and these custom resources each (the first is the head); the
    cluster (its `.address` to connect to), this process connected to it."""
    saved = {key: os.environ.get(key) for key in LOOPBACK_ENV}
    os.environ.update(LOOPBACK_ENV)
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    # Ray reads the variable when it is imported: a Ray imported before it was set is told here
    clusters_enabled = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    head, *others = nodes
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": num_cpus,
            "resources": dict(head),
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    try:
        for resources in others:
            cluster.add_node(
                num_cpus=num_cpus, resources=dict(resources), node_ip_address="127.0.0.1"
            )
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="plait", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = clusters_enabled
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
