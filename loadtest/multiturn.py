"""Sticky vs round-robin on a vLLM multi_turn-style workload: one shared system prompt, a
per-conversation prefix, and turns that grow the context. Reports TTFT per turn, the prefix-reuse
ratio (usage.prompt_tokens_details.cached_tokens / prompt_tokens) and throughput, per policy.

`--policy sticky|round_robin --url URL` measures one deployment (labelled with that policy);
`--policy both` takes --sticky-url and --round-robin-url, or deploys each federation in turn
locally (fedserve only) when they are not given.
"""

from __future__ import annotations

import argparse

from loadtest import report
from loadtest.client import chat_body, model_name
from loadtest.sessions import run_many

NAME = "multiturn"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", choices=["sticky", "round_robin", "both"], default="both")
    p.add_argument("--url", default=None, help="the deployment to measure (single policy)")
    p.add_argument("--sticky-url", default=None)
    p.add_argument("--round-robin-url", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=256, help="shared by all conversations")
    p.add_argument("--prefix-tokens", type=int, default=256, help="per conversation")
    p.add_argument("--turn-tokens", type=int, default=64, help="new user tokens per turn")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--replicas", type=int, default=2, help="when deploying for --policy both")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--time-limit", type=float, default=1200.0, help="per policy, seconds")
    p.add_argument("--label", default="")
    p.add_argument("--out", default="loadtest-results")


def conversation(index: int, system: str, args):
    prefix = report.filler(args.prefix_tokens, seed=50_000 + index)

    def next_messages(t: int, history: list[dict]):
        ask = report.filler(args.turn_tokens, seed=60_000 + index * 101 + t)
        if t == 0:
            return [{"role": "system", "content": system},
                    {"role": "user", "content": f"Background: {prefix}\n\n{ask}\nSummarize."}]
        return [{"role": "user", "content": f"{ask}\nContinue."}]
    return next_messages


def measure(url: str, policy: str, args) -> dict:
    model = model_name(url, args.model)
    system = "You are a helpful assistant. " + report.filler(args.system_tokens, seed=7)
    convs = [(f"mt-{policy}-{i}", conversation(i, system, args)) for i in range(args.conversations)]

    def body(messages):
        return chat_body(model, messages, args.max_tokens)

    turns, wall = run_many(url, convs, body, args.turns, args.time_limit, args.timeout,
                           concurrency=args.concurrency)
    per_turn = []
    for t in range(args.turns):
        rs = [s[t].result for s in turns if len(s) > t and s[t].result.ok]
        prompt = sum(r.prompt_tokens for r in rs)
        per_turn.append({"turn": t + 1, "n": len(rs),
                         "ttft_s": report.percentiles([r.ttft_s for r in rs]),
                         "prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens for r in rs),
                         "reuse": sum(r.cached_tokens for r in rs) / prompt if prompt else None})
    done = [t.result for s in turns for t in s if t.result.ok]
    prompt = sum(r.prompt_tokens for r in done)
    tokens = sum(r.completion_tokens for r in done)
    replicas = {}
    for s in turns:
        replicas[s[0].result.session if s else "?"] = sorted({t.result.replica for t in s})
    return {"policy": policy, "url": url, "model": model, "requests": sum(len(s) for s in turns),
            "completed": len(done), "wall_s": wall, "completion_tokens": tokens,
            "throughput_tok_s": tokens / wall if wall else 0.0,
            "reuse_ratio": sum(r.cached_tokens for r in done) / prompt if prompt else None,
            "ttft_s": report.percentiles([r.ttft_s for r in done]), "per_turn": per_turn,
            "replicas_per_conversation": sum(len(v) for v in replicas.values()) / max(1, len(replicas))}


def _deployed(policy: str, args) -> dict:
    """Deploy a local fedserve federation with this routing policy, measure it, tear it down."""
    from federation.config import FederationConfig
    from federation.launch import free_port, start, stop, wait_ready

    cfg = FederationConfig(num_replicas=args.replicas, one_replica_per_node=False,
                           router_policy=policy)
    url = start(cfg, "127.0.0.1", free_port())
    try:
        wait_ready(url)
        return measure(url, policy, args)
    finally:
        stop()


def run(args) -> dict:
    if args.policy != "both":
        if not args.url:
            raise SystemExit("--url is required with a single --policy")
        results = [measure(args.url, args.policy, args)]
    else:
        urls = {"sticky": args.sticky_url, "round_robin": args.round_robin_url}
        results = [measure(urls[p], p, args) if urls[p] else _deployed(p, args)
                   for p in ("sticky", "round_robin")]
    out = {"scenario": NAME, "label": args.label, "results": results,
           "params": {k: getattr(args, k) for k in ("conversations", "concurrency", "turns",
                                                    "system_tokens", "prefix_tokens",
                                                    "turn_tokens", "max_tokens")}}
    if len(results) == 2:
        s, r = results
        last_s, last_r = s["per_turn"][-1]["ttft_s"]["mean"], r["per_turn"][-1]["ttft_s"]["mean"]
        out["sticky_over_round_robin"] = {
            "throughput": s["throughput_tok_s"] / r["throughput_tok_s"] if r["throughput_tok_s"] else None,
            "ttft_last_turn": last_s / last_r if last_s and last_r else None}
    return out


def render(res: dict) -> tuple[str, dict]:
    rows = [[r["policy"], f"{r['completed']}/{r['requests']}", f"{r['throughput_tok_s']:.1f}",
             "-" if r["reuse_ratio"] is None else f"{r['reuse_ratio']:.1%}",
             report.ms(r["ttft_s"]["p50"]), report.ms(r["per_turn"][-1]["ttft_s"]["mean"]),
             f"{r['replicas_per_conversation']:.2f}"] for r in res["results"]]
    table = report.md_table(["policy", "completed", "tok/s", "prefix reuse", "TTFT p50",
                             "TTFT last turn (mean)", "replicas / conversation"], rows)
    turn_rows = [[p["turn"]] + [f"{report.ms(r['per_turn'][i]['ttft_s']['mean'])}, reuse "
                                + ("-" if r["per_turn"][i]["reuse"] is None
                                   else f"{r['per_turn'][i]['reuse']:.0%}")
                                for r in res["results"]]
                 for i, p in enumerate(res["results"][0]["per_turn"])]
    per_turn = report.md_table(["turn"] + [r["policy"] for r in res["results"]], turn_rows)
    ratio = res.get("sticky_over_round_robin")
    ratio_md = ""
    if ratio:
        fmt = lambda x: "-" if x is None else f"{x:.2f}×"  # noqa: E731
        ratio_md = (f"\nsticky / round_robin: throughput {fmt(ratio['throughput'])}, "
                    f"TTFT at the last turn {fmt(ratio['ttft_last_turn'])}\n")
    figs = {}
    for key, ylabel in (("ttft", "mean TTFT (s)"), ("reuse", "prefix reuse ratio")):
        fig, ax = report.new_figure()
        for r in res["results"]:
            ys = [p["ttft_s"]["mean"] if key == "ttft" else p["reuse"] for p in r["per_turn"]]
            ax.plot([p["turn"] for p in r["per_turn"]], ys, marker="o", label=r["policy"])
        ax.set_xlabel("turn")
        ax.set_ylabel(ylabel)
        ax.legend()
        ax.set_title(f"{ylabel} per turn {res['label']}")
        figs[key] = fig
    md = f"# Sticky vs round-robin {res['label']}\n\n{table}\n{ratio_md}\n{per_turn}\n"
    return md, figs


def main(args) -> int:
    res = run(args)
    report.emit(args, NAME, res, render)
    return 0 if all(r["completed"] == r["requests"] for r in res["results"]) else 1

