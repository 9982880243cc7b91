"""Multi-node: a simulated 3-node Ray cluster (ray.cluster_utils.Cluster). One replica lands on
each worker node; removing a node loses no accepted request and the service keeps answering."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from federation.config import FederationConfig
from federation.launch import free_port, wait_ready

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"


def actor_nodes(prefix: str) -> dict[str, str]:
    from ray.util.state import list_actors

    return {a.name: a.node_id for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
            if a.name and a.name.startswith(prefix)}


def test_one_replica_per_node_and_node_loss_loses_nothing():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    from federation.launch import start, stop

    # the head has fewer (logical) CPUs than one replica asks for (1 < 1.5), whatever else lands there,
    # so replicas can only go to the workers; a worker holds one replica and the ingress (1.6 <= 2)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    try:
        cfg = FederationConfig(num_replicas=2, one_replica_per_node=True, replica_num_cpus=1.5,
                               max_failovers=6)
        # one proxy, on the head: the simulated nodes share one host, so per-node proxies would
        # share one port and a removed node would take its proxy's client connections with it
        url = start(cfg, "127.0.0.1", free_port(), proxy_location="HeadOnly")
        wait_ready(url)
        nodes = actor_nodes("SERVE_REPLICA::fedserve#Replica#")
        worker_ids = {w.node_id for w in workers}
        assert len(nodes) == 2 and set(nodes.values()) == worker_ids, (nodes, worker_ids)

        results: list[int | str] = []  # a status code, or the client-side error's name
        stop_flag = threading.Event()

        def client(i: int) -> None:
            n = 0
            while not stop_flag.is_set() and n < 40:
                body = {"model": MODEL, "max_tokens": 12, "temperature": 0,
                        "messages": [{"role": "user", "content": f"client {i} request {n}"}]}
                try:
                    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=180)
                    results.append(r.status_code)
                except httpx.HTTPError as e:  # a lost request counts as one
                    results.append(type(e).__name__)
                n += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        # lose a replica's machine; the ingress (one Serve replica) may share a worker, and this test
        # is about replica loss, so the worker without it goes
        ingress_node = set(actor_nodes("SERVE_REPLICA::fedserve#Ingress#").values())
        victim = next(w for w in workers if w.node_id not in ingress_node)
        time.sleep(4)
        cluster.remove_node(victim)
        time.sleep(8)
        stop_flag.set()
        for t in threads:
            t.join(timeout=300)
        assert results and all(s == 200 for s in results), results
        after = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                           json={"model": MODEL, "max_tokens": 8, "temperature": 0,
                                 "messages": [{"role": "user", "content": "still serving?"}]})
        assert after.status_code == 200
    finally:
        stop()
        cluster.shutdown()
