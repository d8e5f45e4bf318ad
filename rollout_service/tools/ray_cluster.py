"""The Ray Serve app on a Ray cluster of several nodes started on this host: one engine
replica per node, each node its own raylet, object store and worker processes, as on
separate hosts (they share only the network stack). How the tests and
``bench/weight_sync_fanout.py`` run pushes across hosts on one machine.

Runs in the caller's process, which becomes the cluster's driver (it deploys the app and
then only talks HTTP to it, like any trainer). The cluster is Ray's own
``ray.cluster_utils.Cluster``; each worker node carries one unit of the custom resource
:data:`REPLICA_HOST` and each engine replica asks for one, so Ray places every replica on
a node of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from rollout_service.serve.config import RayServeConfig
from rollout_service.tools.launch import free_port

REPLICA_HOST = "rollout_replica_host"
"""The custom resource of a node that takes one engine replica."""
OBJECT_STORE_BYTES = 100 * 1024**2
"""Each node's Ray object store: the app passes only control messages through it."""
KEEP_ALIVE_S = 90
"""Serve's HTTP keep-alive: past the clients' own idle expiry (``ServiceConfig.
http_keep_alive_s`` says why)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeOnNodes:
    """A running app on a simulated multi-node cluster."""

    url: str
    """The Serve HTTP endpoint (the ingress)."""
    node_ids: tuple[str, ...]
    """The worker nodes that host the replicas."""


def replica_node_ids(app_name: str) -> dict[str, str]:
    """Each live engine replica's actor name -> its Ray node id (Ray's state API)."""
    from ray.util.state import list_actors

    actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
    return {a.name: a.node_id for a in actors
            if a.class_name and a.class_name.endswith(f"{app_name}:RolloutEngine")}


class SimulatedCluster:
    """A head and ``num_nodes`` worker nodes on this host, with Serve's HTTP proxy up;
    apps are deployed on it one or several at a time (:meth:`deploy`)."""

    def __init__(self, num_nodes: int, *, cpus_per_node: float, head_cpus: float) -> None:
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        self.num_nodes = num_nodes
        # The dashboard on a port of its own: with Ray's 8265 taken (another Ray on the
        # host) the head starts without one, and Ray's state API (replica_node_ids) fails.
        self._cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": head_cpus, "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": True, "dashboard_port": free_port()})
        self.node_ids = tuple(
            self._cluster.add_node(num_cpus=cpus_per_node, resources={REPLICA_HOST: 1},
                                   object_store_memory=OBJECT_STORE_BYTES).node_id
            for _ in range(num_nodes))
        ray.init(address=self._cluster.address)
        self.port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port,
                                  "keep_alive_timeout_s": KEEP_ALIVE_S})

    def deploy(self, config: RayServeConfig, *, route_prefix: str = "/",
               ready_timeout_s: float = 900.0) -> str:
        """Deploy ``config`` (app ``config.app_name``) with each replica on a worker node
        of its own; returns its URL once every replica serves.

        Raises:
            ValueError: more replicas than free nodes.
            TimeoutError: not serving within ``ready_timeout_s``.
        """
        from ray import serve

        from rollout_service.serve.app import build_app

        if config.num_replicas > self.num_nodes:
            raise ValueError(f"num_replicas: {config.num_replicas} replicas need as many "
                             f"nodes, not {self.num_nodes}")
        options: dict[str, Any] = dict(config.ray_actor_options)
        options["resources"] = {**options.get("resources", {}), REPLICA_HOST: 1}
        config = config.model_copy(update={"ray_actor_options": options})
        serve.run(build_app(config), name=config.app_name, route_prefix=route_prefix)
        url = f"http://127.0.0.1:{self.port}{route_prefix.rstrip('/')}"
        _wait_serving(url, config.num_replicas, ready_timeout_s)
        return url

    def delete(self, app_name: str) -> None:
        from ray import serve

        serve.delete(app_name)

    def shutdown(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            self._cluster.shutdown()


@contextmanager
def simulated_cluster(num_nodes: int, *, cpus_per_node: float = 1.0,
                      head_cpus: float = 1.0) -> Iterator[SimulatedCluster]:
    cluster = SimulatedCluster(num_nodes, cpus_per_node=cpus_per_node, head_cpus=head_cpus)
    try:
        yield cluster
    finally:
        cluster.shutdown()


@contextmanager
def serve_on_nodes(config: RayServeConfig, *, num_nodes: int, cpus_per_node: float = 1.0,
                   head_cpus: float = 1.0, ready_timeout_s: float = 900.0
                   ) -> Iterator[ServeOnNodes]:
    """One app on a cluster of its own (:class:`SimulatedCluster`), every replica
    serving."""
    with simulated_cluster(num_nodes, cpus_per_node=cpus_per_node,
                           head_cpus=head_cpus) as cluster:
        url = cluster.deploy(config, ready_timeout_s=ready_timeout_s)
        yield ServeOnNodes(url=url, node_ids=cluster.node_ids)


def _wait_serving(url: str, num_replicas: int, timeout_s: float) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            body = httpx.get(f"{url}/health", timeout=30).json()
            last = body
            serving = [r for r in body.get("replicas") or () if r["status"] == "ok"]
            if len(serving) >= num_replicas:
                return
        except (httpx.HTTPError, ValueError) as exc:
            last = exc
        time.sleep(1.0)
    raise TimeoutError(f"the app did not serve {num_replicas} replicas within "
                       f"{timeout_s:g} s; last /health: {last!r}")
