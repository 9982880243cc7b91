"""The `fedserve` command line. Subcommands import what they need lazily, so `generate` never
imports Ray and `up` never imports transformers."""

from __future__ import annotations

import argparse
import sys


def _streams(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {text!r}")
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError("stream counts must be positive")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedserve", description="fedserve: federated LLM serving")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt with the local engine")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="treat PROMPT as a user chat message")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--model", default="smollm2-135m")

    u = sub.add_parser("up", help="start Ray locally and serve the federation over HTTP")
    u.add_argument("--replicas", type=int, default=1)
    u.add_argument("--model", default="smollm2-135m")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=8000)
    u.add_argument("--max-running-streams", type=int, default=32,
                   help="per replica; 1 = the serialized-decode mode")
    u.add_argument("--policy", choices=["sticky", "round_robin"], default="sticky")
    u.add_argument("--api-key", action="append", default=[], dest="api_keys",
                   help="accept this key (repeatable; also FEDSERVE_API_KEYS=k1,k2); each key "
                        "is a tenant. Without keys, only 127.0.0.1 may be served")
    u.add_argument("--metrics-port", type=int, default=None,
                   help="serve Ray's Prometheus scrape (fedserve_* and ray_serve_*) on this port")
    u.add_argument("--rate-limit", type=float, default=0.0,
                   help="requests per second per key (0: off); over it, 429 + Retry-After")
    u.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per replica)")
    u.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: the share of the memory free after the weights that the KV pool "
                        "and the step's buffers may take")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="engine tok/s and TTFT per concurrency")
    be.add_argument("--model", default="smollm2-135m")
    be.add_argument("--streams", type=_streams, default=None,
                    help="concurrencies (default 1,4,8,16; with --context 1,8,32,64)")
    be.add_argument("--context", type=_streams, default=None,
                    help="prompt lengths in tokens: prefill/decode rates per context and concurrency")
    be.add_argument("--max-tokens", type=int, default=64)
    be.add_argument("--json", default=None, help="write results to this JSON file")
    be.add_argument("--compare-transformers", action="store_true")
    be.add_argument("--device", default="cpu")
    be.add_argument("--profile", action="store_true",
                    help="instead: profile the host side of the step loop at the largest --streams")
    be.add_argument("--temperature", type=float, default=0.0,
                    help="with --context: every stream samples at this temperature (0: greedy)")
    be.add_argument("--top-p", type=float, default=1.0, help="with --context and --temperature")
    be.add_argument("--warm-buckets", action="store_true",
                    help="with --context on CUDA: capture every decode graph bucket before timing "
                         "(bench-only; by default the engine's own capture policy runs)")
    bf = bsub.add_parser("federation", help="routing overhead and 1 vs 2 replica throughput")
    bf.add_argument("--model", default="smollm2-135m")
    bf.add_argument("--requests", type=int, default=50)
    bf.add_argument("--streams", type=int, default=8)
    bf.add_argument("--max-tokens", type=int, default=48)
    bf.add_argument("--json", default=None)

    dep = sub.add_parser("deploy", help="check a Serve config (cluster/*.yaml), then deploy it "
                                        "to a running Ray cluster (as `serve deploy` does)")
    dep.add_argument("config", help="a Serve config file, e.g. cluster/gpu.yaml")
    dep.add_argument("--address", default=None, help="the Ray dashboard's address (default: "
                     "RAY_DASHBOARD_ADDRESS, else http://127.0.0.1:8265)")
    dep.add_argument("--check", action="store_true", help="only check the file; deploy nothing")

    st = sub.add_parser("status", help="one screen: replicas, their load, KV use and sessions")
    st.add_argument("--url", default="http://127.0.0.1:8000", help="the federation's base URL")
    st.add_argument("--api-key", default=None, help="sent as a Bearer token, where keys are required")
    st.add_argument("--json", action="store_true", help="print the raw status JSON instead")

    d = sub.add_parser("dashboards", help="the Grafana dashboard (fedserve and Ray Serve metrics)")
    dsub = d.add_subparsers(dest="dashboards", required=True)
    de = dsub.add_parser("export", help="write the dashboard JSON (stdout without --out)")
    de.add_argument("--out", default=None)
    dp = dsub.add_parser("push", help="create or replace the dashboard on a Grafana server")
    dp.add_argument("--url", required=True, help="Grafana's base URL")
    dp.add_argument("--token", required=True, help="a Grafana service-account token")
    dp.add_argument("--folder-uid", default=None)

    # ---- loadtest: scenarios against any OpenAI-compatible URL (code in loadtest/) ----
    lt = sub.add_parser("loadtest", help="load tests and reproducers (reports: JSON, Markdown, PNG)")
    ltsub = lt.add_subparsers(dest="loadtest", required=True)
    for name, help_ in LOADTEST_SCENARIOS.items():
        _loadtest_module(name).add_args(ltsub.add_parser(name, help=help_))
    return p


LOADTEST_SCENARIOS = {
    "matrix": "crash matrix: sequential/concurrent chats and embeddings",
    "corruption": "concurrent growing multi-turn sessions vs their solo replay, bitwise",
    "needle": "needle-in-a-haystack recall by depth and length",
    "multiturn": "sticky vs round-robin on a multi-turn workload",
    "capstone": "four concurrent tool-using sub-agents under a deny policy",
    "overload": "offered load beyond capacity: 429s, never a 5xx, every accepted stream completes",
}


def _loadtest_module(name: str):
    import importlib

    return importlib.import_module(f"loadtest.{name}")


def cmd_generate(args) -> int:
    from replica import Engine, EngineConfig, FedserveError, Request, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed)
        engine = Engine(EngineConfig(model=args.model))
    except FedserveError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    try:
        req = (Request(messages=({"role": "user", "content": args.prompt},), params=params)
               if args.chat else Request(prompt=args.prompt, params=params))
        out = engine.generate([req])[0]
    except FedserveError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    print(out.text)
    return 0


def cmd_up(args) -> int:
    from pydantic import ValidationError

    import os

    from federation.config import FederationConfig, check_exposure, env_api_keys
    from federation.launch import serve_until_signal

    try:
        cfg = FederationConfig(model=args.model, num_replicas=args.replicas,
                               max_running_streams=args.max_running_streams,
                               router_policy=args.policy, one_replica_per_node=False,
                               api_keys=tuple(args.api_keys) + env_api_keys(dict(os.environ)),
                               rate_limit_rps=args.rate_limit, device=args.device,
                               replica_num_gpus=0 if args.device == "cpu" else 1,
                               gpu_memory_utilization=args.gpu_memory_utilization)
        check_exposure(args.host, cfg)
    except ValidationError as e:
        print(f"error: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return serve_until_signal(cfg, args.host, args.port, args.metrics_port)


def cmd_bench_engine(args) -> int:
    from bench import engine as bench

    streams = args.streams or ([1, 8, 32, 64] if args.context else [1, 4, 8, 16])
    if args.profile:
        bench.profile_steps(args.model, max(streams), args.max_tokens, args.device)
        return 0
    if args.context:
        from bench import engine_context as bench_context

        bench_context.run(args.model, args.context, streams, args.max_tokens, args.json,
                          {"device": args.device}, warm_buckets=args.warm_buckets,
                          temperature=args.temperature, top_p=args.top_p)
        return 0
    bench.run(args.model, streams, args.max_tokens, args.compare_transformers, args.json,
              {"device": args.device})
    return 0


def cmd_deploy(args) -> int:
    import os

    from federation import deploy

    try:
        deploy.check(deploy.load(args.config))
    except (OSError, ValueError) as e:
        print(f"error: {args.config}: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{args.config}: ok")
        return 0
    address = args.address or os.environ.get("RAY_DASHBOARD_ADDRESS") or deploy.DEFAULT_ADDRESS
    deploy.deploy(args.config, address)
    print(f"deployed {args.config} to {address}; watch it with `serve status` or `fedserve status`")
    return 0


def cmd_status(args) -> int:
    import httpx

    from federation.status import render

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(f"{args.url.rstrip('/')}/v1/fedserve/status", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        print(f"error: {args.url}: {e}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"error: {args.url}: HTTP {r.status_code}: {r.text[:200]}", file=sys.stderr)
        return 1
    print(r.text if args.json else render(r.json()))
    return 0


def cmd_dashboards(args) -> int:
    from federation import dashboards

    if args.dashboards == "export":
        text = dashboards.export(args.out)
        if args.out is None:
            sys.stdout.write(text)
        return 0
    answer = dashboards.push(args.url, args.token, args.folder_uid)
    print(f"pushed {dashboards.UID!r}: {answer.get('status', answer)} {answer.get('url', '')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "up":
        return cmd_up(args)
    if args.command == "deploy":
        return cmd_deploy(args)
    if args.command == "status":
        return cmd_status(args)
    if args.command == "dashboards":
        return cmd_dashboards(args)
    if args.command == "loadtest":
        return _loadtest_module(args.loadtest).main(args)
    if args.command == "bench" and args.bench == "engine":
        return cmd_bench_engine(args)
    if args.command == "bench" and args.bench == "federation":
        from bench import federation_bench as bench

        bench.bench(args.model, args.requests, args.streams, args.max_tokens, args.json)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
