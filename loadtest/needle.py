"""Needle recall: a fact placed at varying depths in filler of varying lengths (up to a limit);
the model is asked for it, greedy. Recall = the fact's number appears in the answer."""

from __future__ import annotations

import argparse

from loadtest import report
from loadtest.client import chat_body, model_name, stream_chat
from loadtest.sessions import http_client

NAME = "needle"


def _floats(text: str) -> list[float]:
    out = [float(x) for x in text.split(",") if x.strip()]
    if not out or any(not 0 <= x <= 1 for x in out):
        raise argparse.ArgumentTypeError("depths are fractions in [0, 1]")
    return out


def _ints(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError("lengths are positive token counts")
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--lengths", type=_ints, default=[256, 512, 1024, 2048, 4096],
                   help="filler lengths in tokens (approximate)")
    p.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--max-context", type=int, default=8192, help="lengths above this are skipped")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--label", default="")
    p.add_argument("--out", default="loadtest-results")


def haystack(length: int, depth: float, code: str, seed: int) -> str:
    """Filler of ~length tokens with the needle sentence inserted at fraction `depth`."""
    words = report.filler(length, seed).split(" ")
    cut = round(depth * len(words))
    needle = f"The secret code is {code}."
    return " ".join(words[:cut] + [needle] + words[cut:])


def run(args) -> dict:
    model = model_name(args.url, args.model)
    lengths = [n for n in args.lengths if n <= args.max_context]
    cells = []
    with http_client(1) as client:
        for li, length in enumerate(lengths):
            for di, depth in enumerate(args.depths):
                code = str(10000 + (li * 7919 + di * 104729) % 89999)
                doc = haystack(length, depth, code, seed=li * 31 + di)
                msgs = [{"role": "user", "content": f"{doc}\n\nWhat is the secret code? "
                                                    f"Answer with the number only."}]
                r = stream_chat(client, args.url, chat_body(model, msgs, args.max_tokens),
                                session=f"needle-{length}-{depth}", timeout=args.timeout)
                cells.append({"length": length, "depth": depth, "code": code, "ok": r.ok,
                              "found": r.ok and code in r.text, "answer": r.text,
                              "prompt_tokens": r.prompt_tokens, "ttft_s": r.ttft_s,
                              "error": r.error})
    found = [c["found"] for c in cells]
    return {"scenario": NAME, "label": args.label, "url": args.url, "model": model,
            "lengths": lengths, "depths": args.depths, "skipped_lengths":
            [n for n in args.lengths if n > args.max_context], "cells": cells,
            "recall": sum(found) / len(found) if found else None,
            "errors": sum(not c["ok"] for c in cells)}


def render(res: dict) -> tuple[str, dict]:
    by = {(c["length"], c["depth"]): c for c in res["cells"]}
    rows = [[f"{n} ({by[(n, res['depths'][0])]['prompt_tokens']} tok)"]
            + [("✓" if by[(n, d)]["found"] else "✗" if by[(n, d)]["ok"] else "error")
               for d in res["depths"]] for n in res["lengths"]]
    table = report.md_table(["filler length \\ depth"] + [f"{d:.0%}" for d in res["depths"]], rows)
    fig, ax = report.new_figure()
    grid = [[1.0 if by[(n, d)]["found"] else 0.0 for n in res["lengths"]] for d in res["depths"]]
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(res["lengths"])), [str(n) for n in res["lengths"]])
    ax.set_yticks(range(len(res["depths"])), [f"{d:.0%}" for d in res["depths"]])
    ax.set_xlabel("filler length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"needle recall {res['label']}")
    fig.colorbar(im, ax=ax)
    recall = "-" if res["recall"] is None else f"{res['recall']:.0%}"
    return f"# Needle recall {res['label']}\n\nrecall: {recall}\n\n{table}\n", {"heatmap": fig}


def main(args) -> int:
    res = run(args)
    report.emit(args, NAME, res, render)
    return 0 if not res["errors"] else 1

