"""The corruption check: N concurrent multi-turn sessions whose contexts grow every turn; every
assistant message compared byte for byte with a reference made by replaying the same messages alone.

Phase 1 runs all sessions concurrently (each turn appends filler so the prompt grows from about
--start-tokens to about --end-tokens). Phase 2 replays every recorded turn's exact message list one
request at a time. Greedy by default (or seeded with --temperature/--seed), so on a batch-invariant
server any byte of difference is a bug. Exits 1 on any corruption, 2 if nothing could be verified.
"""

from __future__ import annotations

import argparse
import sys

from loadtest import report
from loadtest.client import chat_body, model_name
from loadtest.sessions import replay, run_many

NAME = "corruption"
SYSTEM = "You are a careful assistant. Answer briefly."


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="OpenAI-compatible base URL (without /v1)")
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--sessions", type=int, default=80)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--start-tokens", type=int, default=512)
    p.add_argument("--end-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1234, help="sent with every request")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/fedserve extension)")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--time-limit", type=float, default=1800.0, help="concurrent phase, seconds")
    p.add_argument("--label", default="")
    p.add_argument("--out", default="loadtest-results")


def session_plan(index: int, turns: int, start: int, end: int):
    """Session `index`: turn 0 carries ~start tokens of filler, each later turn adds an equal share."""
    step = (end - start) // max(1, turns - 1)

    def next_messages(t: int, history: list[dict]):
        size = start if t == 0 else step
        text = (f"Notes part {t + 1}: {report.filler(size, seed=index * 1009 + t)}\n"
                f"Question {t + 1}: which word appears first in part {t + 1}?")
        head = [{"role": "system", "content": SYSTEM}] if t == 0 else []
        return head + [{"role": "user", "content": text}]
    return next_messages


def run(args) -> dict:
    model = model_name(args.url, args.model)
    extra = {"ignore_eos": True} if args.ignore_eos else {}

    def body(messages):
        return chat_body(model, messages, args.max_tokens, args.temperature, args.seed, **extra)

    plans = [(f"corr-{i}", session_plan(i, args.turns, args.start_tokens, args.end_tokens))
             for i in range(args.sessions)]
    print(f"phase 1: {args.sessions} sessions × {args.turns} turns, concurrently", file=sys.stderr)
    turns, wall = run_many(args.url, plans, body, args.turns, args.time_limit, args.timeout)
    print(f"phase 1 done in {wall:.1f} s; phase 2: replaying each turn alone", file=sys.stderr)
    refs = replay(args.url, turns, body, args.timeout)

    records, corrupted, unverified = [], 0, 0
    for session, ref in zip(turns, refs):
        for t, r in zip(session, ref):
            res = t.result
            verdict = ("failed" if not res.ok else "unverified" if not r.ok
                       else "equal" if res.text == r.text else "CORRUPTED")
            corrupted += verdict == "CORRUPTED"
            unverified += verdict == "unverified"
            records.append({"session": t.session, "turn": t.turn, "verdict": verdict,
                            **res.summary(), "ref_ok": r.ok,
                            "text": res.text, "reference": r.text if verdict == "CORRUPTED" else None})
    done = [r for r in records if r["ok"]]
    timeouts = sum(r["timed_out"] for r in records)
    sessions_timed_out = len({r["session"] for r in records if r["timed_out"]})
    verified = sum(r["verdict"] in ("equal", "CORRUPTED") for r in records)
    all_ttft = [r["ttft_s"] for r in done]
    itl = [x for session in turns for t in session if t.result.ok for x in t.result.itl_s]
    tokens = sum(r["completion_tokens"] or 0 for r in done)
    prompt_tokens = [r["prompt_tokens"] for r in done if r["prompt_tokens"]]
    return {
        "scenario": NAME, "label": args.label, "url": args.url, "model": model,
        "params": {k: getattr(args, k) for k in ("sessions", "turns", "start_tokens", "end_tokens",
                                                 "max_tokens", "temperature", "seed", "ignore_eos")},
        "requests": len(records), "completed": len(done), "verified": verified,
        "corrupted": corrupted, "unverified": unverified,
        "corruption_rate": corrupted / verified if verified else None,
        "sessions_corrupted": len({r["session"] for r in records if r["verdict"] == "CORRUPTED"}),
        "timeouts": timeouts, "sessions_timed_out": sessions_timed_out,
        "cut_by_time_limit": sum(r["cut"] for r in records),
        "wall_s": wall, "completion_tokens": tokens, "throughput_tok_s": tokens / wall if wall else 0.0,
        "prompt_tokens_range": [min(prompt_tokens), max(prompt_tokens)] if prompt_tokens else None,
        "ttft_s": report.percentiles(all_ttft), "itl_s": report.percentiles(itl),
        "records": records,
    }


def render(res: dict) -> tuple[str, dict]:
    p = res["params"]
    rate = res["corruption_rate"]
    verdict = ("CORRUPTION" if res["corrupted"] else "CLEAN" if res["verified"] else "UNVERIFIED")
    rows = [["verdict", verdict],
            ["sessions × turns", f"{p['sessions']} × {p['turns']}"],
            ["prompt tokens (min–max)", res["prompt_tokens_range"]],
            ["requests / completed / verified", f"{res['requests']} / {res['completed']} / {res['verified']}"],
            ["corrupted (rate)", f"{res['corrupted']} ({'-' if rate is None else f'{rate:.1%}'})"],
            ["sessions corrupted", res["sessions_corrupted"]],
            ["timeouts (sessions)", f"{res['timeouts']} ({res['sessions_timed_out']})"],
            ["turns cut by --time-limit", res["cut_by_time_limit"]],
            ["throughput", f"{res['throughput_tok_s']:.1f} tok/s over {res['wall_s']:.1f} s"],
            ["TTFT p50/p90/p99", " / ".join(report.ms(res["ttft_s"][k]) for k in ("p50", "p90", "p99"))],
            ["ITL p50/p90/p99", " / ".join(report.ms(res["itl_s"][k]) for k in ("p50", "p90", "p99"))]]
    table = report.md_table(["corruption check " + res["label"], ""], rows)
    bad = [r for r in res["records"] if r["verdict"] == "CORRUPTED"][:5]
    detail = "\n".join(f"- session {r['session']} turn {r['turn']}: got {r['text']!r}, "
                       f"reference {r['reference']!r}" for r in bad)

    fig, ax = report.new_figure()
    ok = [r for r in res["records"] if r["ok"] and r["ttft_s"] is not None]
    for verdict_name, color in (("equal", "tab:blue"), ("unverified", "tab:gray"), ("CORRUPTED", "tab:red")):
        pts = [r for r in ok if r["verdict"] == verdict_name]
        ax.scatter([r["prompt_tokens"] for r in pts], [r["ttft_s"] for r in pts], s=12,
                   color=color, label=verdict_name)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT by context length")
    ax.legend()
    return f"# Corruption check {res['label']}\n\n{table}\n\n{detail}\n", {"ttft": fig}


def main(args) -> int:
    res = run(args)
    report.emit(args, NAME, res, render)
    if res["corrupted"]:
        return 1
    return 0 if res["verified"] else 2

