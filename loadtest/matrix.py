"""The crash matrix: sequential chats, concurrent chats, concurrent embeddings, and both mixed.

Each row is SURVIVED (every request answered and the server still answers afterwards) or CRASHED,
and for chat rows whether every output equals its sequential (greedy) reference. Run it once per
deployment mode (e.g. --label batched, then --label serialized against max_running_streams=1).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

from loadtest import report
from loadtest.client import alive, chat_body, embed, model_name, stream_chat
from loadtest.sessions import http_client

NAME = "matrix"
PROMPTS = ["What is the capital of France?", "Name three primary colors.",
           "Write one sentence about the sea.", "What is 12 plus 30?",
           "Give a synonym for happy.", "Why is the sky blue?", "List two fruits.",
           "Describe a cat in five words."]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--label", default="", help="e.g. batched / serialized")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", default="loadtest-results")


def _row(name: str, chats, embeds, ok_after: bool, refs, wall: float) -> dict:
    failures = [r.error or f"HTTP {r.status}" for r in chats if not r.ok]
    failures += [e for ok, e, _ in embeds if not ok]
    equal = None
    if refs is not None and chats:
        equal = all(r.ok and r.text == ref for r, ref in zip(chats, refs))
    return {"scenario": name, "survived": ok_after and not failures,
            "verdict": "SURVIVED" if ok_after and not failures else "CRASHED",
            "chats": len(chats), "embeddings": len(embeds), "failures": failures[:5],
            "outputs_equal_reference": equal, "wall_s": wall}


def run(args) -> dict:
    model = model_name(args.url, args.model)
    n = args.concurrency
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    bodies = [chat_body(model, [{"role": "user", "content": p}], args.max_tokens) for p in prompts]
    rows = []
    with http_client(2 * n) as client, ThreadPoolExecutor(max_workers=2 * n) as pool:
        def chat(i):
            return stream_chat(client, args.url, bodies[i], session=f"matrix-{args.label}-{i}-{time.time_ns()}",
                               timeout=args.timeout)

        def emb(i):
            return embed(client, args.url, model, [prompts[i], f"embedding {i}"], timeout=args.timeout)

        t0 = time.perf_counter()
        seq = [chat(i) for i in range(n)]
        refs = [r.text for r in seq]
        rows.append(_row("sequential chat", seq, [], alive(args.url), None,
                         time.perf_counter() - t0))
        for name, n_chat, n_emb in ((f"{n} concurrent chats", n, 0),
                                    (f"{n} concurrent embeddings", 0, n),
                                    (f"{n} chats + {n} embeddings", n, n)):
            t0 = time.perf_counter()
            cf = [pool.submit(chat, i) for i in range(n_chat)]
            ef = [pool.submit(emb, i) for i in range(n_emb)]
            chats, embeds = [f.result() for f in cf], [f.result() for f in ef]
            rows.append(_row(name, chats, embeds, alive(args.url), refs if n_chat else None,
                             time.perf_counter() - t0))
    return {"scenario": NAME, "label": args.label, "url": args.url, "model": model,
            "concurrency": n, "max_tokens": args.max_tokens,
            "sequential_references_ok": all(r.ok for r in seq), "rows": rows,
            "all_survived": all(r["survived"] for r in rows),
            "all_equal": all(r["outputs_equal_reference"] is not False for r in rows)}


def render(res: dict) -> tuple[str, dict]:
    eq = {None: "n/a", True: "yes", False: "NO"}
    table = report.md_table(
        ["scenario", "verdict", "outputs = sequential", "wall"],
        [[r["scenario"], r["verdict"], eq[r["outputs_equal_reference"]], f"{r['wall_s']:.1f} s"]
         for r in res["rows"]])
    fig, ax = report.new_figure(7, 3.5)
    colors = ["tab:green" if r["survived"] else "tab:red" for r in res["rows"]]
    ax.barh([r["scenario"] for r in res["rows"]], [r["wall_s"] for r in res["rows"]], color=colors)
    ax.set_xlabel("wall time (s); green = survived, red = crashed")
    ax.set_title(f"crash matrix {res['label']}")
    ax.invert_yaxis()
    return f"# Crash matrix {res['label']}\n\n{table}\n", {"wall": fig}


def main(args) -> int:
    res = run(args)
    report.emit(args, NAME, res, render)
    return 0 if res["all_survived"] and res["all_equal"] else 1

