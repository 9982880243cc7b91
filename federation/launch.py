"""Start the federation locally: Ray on 127.0.0.1, Serve HTTP on the given host/port."""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time

from federation.config import FederationConfig


# Serve gives its HTTP proxy 5 s to report ready and 10 s per health check, three misses in a row
# before it kills and restarts it. A busy machine (replicas loading, two cores) misses that while
# nothing is wrong, and a killed proxy drops every open stream; ours wait longer.
PROXY_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "20",
                  "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}


def start(cfg: FederationConfig, host: str = "127.0.0.1", port: int = 8000,
          num_cpus: int | None = None, proxy_location: str = "EveryNode",
          metrics_export_port: int | None = None) -> str:
    """Init Ray (local, loopback only), deploy the app, return the base URL.

    proxy_location: Serve's HTTP proxies ("EveryNode": one per machine, behind the cluster's
    load balancer; "HeadOnly": one, as a simulated cluster on one host needs, whose nodes would
    otherwise all bind the same address and port).
    metrics_export_port: where this node's Ray metrics agent serves the Prometheus scrape of
    every process on it (fedserve_* and ray_serve_* included); None lets Ray pick one."""
    # Ray on loopback, set (not read) for the processes ray.init starts, which inherit this
    # environment; its workers get the same through runtime_env below
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    for key, seconds in PROXY_PATIENCE.items():  # read by Serve's controller, which ray.init starts
        os.environ[key] = seconds
    import ray
    from ray import serve

    from federation.app import build_app

    if not ray.is_initialized():
        # replicas take fractional CPUs; advertise enough logical CPUs for all of them
        cpus = num_cpus or max(os.cpu_count() or 1,
                               int(cfg.num_replicas * cfg.replica_num_cpus + cfg.ingress_num_cpus) + 1)
        metrics = {"_metrics_export_port": metrics_export_port} if metrics_export_port else {}
        # address="local": always a new instance; a cluster someone started on this machine
        # (`ray start`, a simulated multi-node test) is never joined by accident
        ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                 _node_ip_address="127.0.0.1", **metrics,
                 runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                           **PROXY_PATIENCE}})
    serve.start(http_options={"host": host, "port": port}, proxy_location=proxy_location)
    serve.run(build_app(cfg), name="fedserve", route_prefix="/", blocking=False)
    return f"http://{host}:{port}"


def serve_config(cfg: FederationConfig, host: str = "127.0.0.1", port: int = 8000,
                 proxy_location: str = "EveryNode", replicas: int | None = None) -> dict:
    """The Serve config (what cluster/*.yaml hold) that deploys `cfg`. `replicas` goes into the
    Replica deployment's override: Serve changes that count without restarting the replicas that
    stay, where a change in `args` restarts every replica of the application."""
    app = {"name": "fedserve", "route_prefix": "/", "import_path": "federation.app:build_app",
           "args": cfg.model_dump(mode="json", exclude_defaults=True)}
    if replicas is not None:
        app["deployments"] = [{"name": "Replica", "num_replicas": replicas}]
    return {"proxy_location": proxy_location, "http_options": {"host": host, "port": port},
            "applications": [app]}


def deploy_config(config: dict) -> None:
    """Apply a Serve config on the connected cluster, as `serve deploy` does (through the
    controller directly, so no dashboard is needed)."""
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    client = serve_start(http_options=config.get("http_options"),
                         proxy_location=config.get("proxy_location"))
    client.deploy_apps(schema)


# ports free_port picks from: above Ray's worker ports (10002-19999), below the kernel's
# ephemeral range (32768-60999 on Linux by default; read at the call where it can be)
FREE_PORTS = (20000, 32767)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server about to bind it. Not one from bind(0):
    that is an ephemeral port, and until the server binds it the kernel may hand it to any
    bind(0) or outgoing connection — Ray starts dozens of both on the way (CI once failed with
    Serve's "Failed to bind to address '127.0.0.1:45141'"). A random port outside the ephemeral
    range and Ray's worker ports, checked free (SystemRandom: tests that seed `random` cannot
    make two processes pick alike)."""
    lo, hi = FREE_PORTS
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            hi = min(hi, int(f.read().split()[0]) - 1)
    except (OSError, ValueError, IndexError):
        pass
    pick = random.SystemRandom()
    for _ in range(100 if lo <= hi else 0):
        port = pick.randint(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 300) -> None:
    """Poll GET /ready until a replica answers (or raise TimeoutError)."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def stop() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def kv_pool_line(url: str, cfg: FederationConfig) -> str | None:
    """The line `fedserve up` prints: each replica's KV pool in tokens, from the status endpoint
    (None when it cannot say)."""
    import httpx

    from replica.config import EngineConfig

    headers = {"Authorization": f"Bearer {cfg.api_keys[0]}"} if cfg.api_keys else {}
    try:
        r = httpx.get(f"{url}/v1/fedserve/status", headers=headers, timeout=60)
        replicas = r.json()["replicas"] if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    if not replicas:
        return None
    sizes = [r.get("kv_capacity_tokens") or r["kv_blocks_total"] * EngineConfig.block_size
             for r in replicas]
    return "KV pool per replica: " + ", ".join(f"{n:,} tokens" for n in sizes)


def serve_until_signal(cfg: FederationConfig, host: str, port: int,
                       metrics_export_port: int | None = None) -> int:
    """`fedserve up`: deploy, print how to call it, serve until SIGINT/SIGTERM, shut down."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    url = start(cfg, host, port, metrics_export_port=metrics_export_port)
    try:
        print(f"fedserve is serving {cfg.name!r} with {cfg.num_replicas} replica(s) at {url}/v1",
              flush=True)
        print(f"""try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{cfg.name}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'""",
              flush=True)
        pool = kv_pool_line(url, cfg)
        if pool:
            print(pool, flush=True)
        if metrics_export_port:
            print(f"Prometheus scrape: http://127.0.0.1:{metrics_export_port}/metrics "
                  f"(status: fedserve status --url {url})", flush=True)
        done.wait()
        print("shutting down", flush=True)
    finally:
        stop()
    return 0
