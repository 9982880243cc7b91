"""Where the host time between two decode steps goes, on the GPU (the wall of a decode step is
its CUDA graph plus ~0.3 ms at 1 stream and ~1.0 ms at 64: GPU_NOTES v11).

For each concurrency, S streams of 128-token prompts on synthetic:qwen3-30b-a3b-int4 (default
EngineConfig: graphs, overlapped events; lookahead on, then off) decode; over the timed steps
each step is cut by host time stamps into (a phase a step does not have counts 0: with
lookahead a step launches the next before it waits, and such a step has no schedule)
  schedule   Scheduler.schedule
  stage      the graph's inputs staged and copied (DecodeGraphs.launch up to the replay)
  launch     CUDAGraph.replay (the call: the host's cost of launching it)
  overlap    what runs while the graph does (runner.while_running: the last step's events)
  wait       the host blocked until the step's ids are back
  after      the rest of the step (ids to tokens, finish checks, deferring events)
and, from CUDA events around the replay, the GPU's busy time and the GPU's idle time between
the end of one step's graph and the start of the next (what the host costs the GPU). Medians,
ms. Not a test.

    python -m bench.step_gaps [--streams 1,8,64] [--steps 40] [--lookahead on,off] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from replica import graphs as graphs_module
from replica.config import EngineConfig
from replica.core import EngineCore
from replica.request import Request
from replica.sampling import SamplingParams

PHASES = ("schedule", "stage", "launch", "overlap", "wait", "after")


class Stamps:
    """Host time stamps and CUDA events of the steps run while installed. With lookahead a
    step launches the next one before it waits on its own (no schedule on such steps): its
    phases are those it has, each stamp's time since the one before."""

    def __init__(self, core: EngineCore) -> None:
        self.core, self.t, self.events = core, {}, []
        self.steps: list[dict[str, float]] = []
        runner, sched = core.runner, core.scheduler
        schedule, collect, overlap = sched.schedule, runner.collect, runner._overlap
        stamps = self

        def timed_schedule():
            out = schedule()
            stamps.t["schedule"] = time.perf_counter()
            return out

        def launch(self_graphs, record, feed_ids=None):  # DecodeGraphs.launch, stamped
            key = self_graphs.key(record)
            g = self_graphs._graphs.get(key)
            if g is None:
                g = self_graphs._graphs[key] = graphs_module._Graph(
                    self_graphs.model, self_graphs.kv, *key, self_graphs.device)
            g.load(record, self_graphs.block_size, self_graphs.tables, feed_ids)
            stamps.t["stage"] = time.perf_counter()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.graph.replay()
            b.record()
            stamps.t["launch"] = time.perf_counter()
            stamps.events.append((a, b))
            return g.logits, g.argmax

        def timed_overlap():
            overlap()
            stamps.t["overlap"] = time.perf_counter()

        def timed_collect(launched):
            out = collect(launched)
            stamps.t["wait"] = time.perf_counter()
            return out

        sched.schedule = timed_schedule
        runner._overlap, runner.collect = timed_overlap, timed_collect
        self._undo = lambda: (delattr(sched, "schedule"), delattr(runner, "_overlap"),
                              delattr(runner, "collect"))
        self._launch = graphs_module.DecodeGraphs.launch
        graphs_module.DecodeGraphs.launch = launch

    def step(self) -> None:
        n = len(self.events)
        self.t = {"start": time.perf_counter()}
        self.core.step()
        t = self.t
        t["after"] = time.perf_counter()
        if len(self.events) > n:  # a graph was launched
            last = t["start"]
            row = {}
            for p in PHASES:
                row[p] = 1e3 * (t[p] - last) if p in t else 0.0
                last = t.get(p, last)
            self.steps.append(row)

    def close(self) -> list[tuple[float, float]]:
        """→ (GPU busy ms, GPU idle ms before it) of each graph launch after the first."""
        graphs_module.DecodeGraphs.launch = self._launch
        self._undo()
        torch.cuda.synchronize()
        return [(cur[0].elapsed_time(cur[1]), prev[1].elapsed_time(cur[0]))
                for prev, cur in zip(self.events, self.events[1:])]


def run_streams(core: EngineCore, streams: int, steps: int) -> dict:
    vocab = core.model_config.vocab_size
    g = torch.Generator().manual_seed(streams)
    params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        ids = torch.randint(0, vocab - 512, (128,), generator=g).tolist()
        core.add(core.prepare(Request(prompt_token_ids=ids, params=params, request_id=f"s{streams}-{i}")),
                 lambda ev: None)
    for _ in range(8):  # prefill, then a few decode steps (graph capture on first use)
        core.step()
    stamps = Stamps(core)
    try:
        for _ in range(steps):
            stamps.step()
    finally:
        gpu = stamps.close()
    for i in range(streams):
        core.abort(f"s{streams}-{i}")
    med = {p: statistics.median(r[p] for r in stamps.steps) for p in PHASES}
    busy = statistics.median(b for b, _ in gpu)
    idle = statistics.median(i for _, i in gpu)
    return {"streams": streams, "host_ms": med, "host_total_ms": sum(med.values()),
            "gpu_busy_ms": busy, "gpu_idle_ms": idle, "steps": len(stamps.steps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:qwen3-30b-a3b-int4")
    ap.add_argument("--streams", default="1,8,64")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lookahead", default="on,off",
                    help="EngineConfig.lookahead settings to run, in turn (on is the default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    print(f"host ms per decode step by phase (medians over {args.steps} steps), GPU busy / idle")
    print(f"{'lookahead':>9} {'streams':>7} " + " ".join(f"{p:>8}" for p in PHASES)
          + f" {'host':>7} {'GPU busy':>8} {'GPU idle':>8}")
    for mode in args.lookahead.split(","):
        core = EngineCore(EngineConfig(model=args.model, device="cuda", max_running_streams=128,
                                       lookahead=mode == "on"))
        for s in args.streams.split(","):
            r = dict(run_streams(core, int(s), args.steps), lookahead=mode)
            rows.append(r)
            print(f"{mode:>9} {r['streams']:>7} " + " ".join(f"{r['host_ms'][p]:>8.3f}" for p in PHASES)
                  + f" {r['host_total_ms']:>7.3f} {r['gpu_busy_ms']:>8.3f} {r['gpu_idle_ms']:>8.3f}",
                  flush=True)
        del core
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
