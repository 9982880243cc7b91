"""The Serve application: an OpenAI-compatible ingress in front of one replica per machine.

`build_app(config)` is also the builder for `serve run federation.app:build_app` and the Serve
config YAML (cluster/*.yaml), whose `args` are FederationConfig fields.
"""

from __future__ import annotations

from ray import serve
from ray.serve.config import RequestRouterConfig

from federation.config import FederationConfig
from federation.ingress import Ingress
from replica.server import ReplicaServer

ROUTERS = {"sticky": "federation.router:StickyRouter",
           "round_robin": "federation.router:RoundRobinRouter"}


def build_app(config: FederationConfig | dict | None = None):
    """The federation as a Serve application (bind it with serve.run)."""
    cfg = config if isinstance(config, FederationConfig) else FederationConfig(**(config or {}))
    actor_options = {"num_cpus": cfg.replica_num_cpus}
    # an engine on cuda holds a whole GPU unless the config says otherwise
    gpus = cfg.replica_num_gpus or (1 if cfg.device.startswith("cuda") else 0)
    if gpus:
        actor_options["num_gpus"] = gpus
    replica = serve.deployment(
        ReplicaServer,
        name="Replica",
        num_replicas=cfg.num_replicas,
        max_replicas_per_node=1 if cfg.one_replica_per_node else None,
        ray_actor_options=actor_options,
        # every stream of a replica plus its queue; admission beyond is the ingress' 429
        max_ongoing_requests=cfg.max_running_streams + cfg.max_queued_requests,
        health_check_period_s=2,
        health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[cfg.router_policy],
            request_routing_stats_period_s=cfg.routing_stats_period_s,
            request_routing_stats_timeout_s=5),
    ).bind(cfg.engine_kwargs())
    ingress = serve.deployment(Ingress, name="Ingress",
                               num_replicas=1, ray_actor_options={"num_cpus": cfg.ingress_num_cpus},
                               max_ongoing_requests=10_000)
    return ingress.bind(replica, cfg.model_dump())

