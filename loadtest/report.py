"""Results on disk: one JSON file, one Markdown report, PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

_WORDS = ("river stone lantern orchard copper meadow harbor violet signal timber canyon "
          "willow engine basket marble thunder pencil garden silver rocket window saddle "
          "planet ribbon forest candle ladder mirror island falcon quiet yellow gentle").split()


def filler(n_tokens: int, seed: int) -> str:
    """Deterministic plain-English filler of about n_tokens tokens (≈ 1 token per short word)."""
    rng = random.Random(seed)
    out, n = [], 0
    while n < n_tokens:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 12))]
        out.append(" ".join(words).capitalize() + ".")
        n += len(words) + 1
    return " ".join(out)


def percentiles(xs: list[float], ps=(50, 90, 99)) -> dict:
    """Nearest-rank percentiles in milliseconds-agnostic units; empty input → None values."""
    xs = sorted(x for x in xs if x is not None)
    out = {}
    for p in ps:
        out[f"p{p}"] = xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))] if xs else None
    out["mean"] = sum(xs) / len(xs) if xs else None
    out["n"] = len(xs)
    return out


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def new_figure(w: float = 6.0, h: float = 4.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(w, h))
    return fig, ax


def write(outdir: str | os.PathLike, name: str, result: dict, markdown: str,
          figures: dict | None = None) -> dict:
    """Write <name>.json, <name>.md and <name>_<plot>.png into outdir; return their paths."""
    import matplotlib.pyplot as plt

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = {}
    for plot, fig in (figures or {}).items():
        path = out / f"{name}_{plot}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        pngs[plot] = path.name
    result = {**result, "plots": pngs}
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
    images = "\n".join(f"![{p}]({f})" for p, f in pngs.items())
    (out / f"{name}.md").write_text(f"{markdown.rstrip()}\n\n{images}\n")
    return {"json": str(out / f"{name}.json"), "md": str(out / f"{name}.md"),
            "png": [str(out / f) for f in pngs.values()]}


def emit(args, name: str, res: dict, render) -> dict:
    """Render a scenario's result, write its report into args.out, print it; return the paths."""
    md, figures = render(res)
    label = getattr(args, "label", "")
    paths = write(args.out, f"{name}_{label}" if label else name, res, md, figures)
    print(md.replace("# ", "", 1).rstrip())
    print(f"\nreport: {paths['md']}")
    return paths
