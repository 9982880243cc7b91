"""Host (Python) time of one engine decode step, by phase, on CPU with the real EngineCore.

N streams decode together (all prompts prefilled first); each timed step is split into
  schedule  Scheduler.schedule()
  build     ModelRunner.build: the eager path's inputs (what a CPU step, or a GPU step that
            is not a pure decode, builds)
  stage     what a GPU decode step does instead of `build`, run on the same record: picking the
            graph (DecodeGraphs.accepts, key) and staging its inputs, into ordinary CPU tensors
  forward   the rest of runner.launch: the model, the greedy argmax and the host rows (device
            work, which a decode graph does on the GPU; not host time, shown for scale)
  pick      ModelRunner.collect: greedy ids and logits rows out of the forward
  post      everything step() does after execute: sampling, detokenizing, finish checks, events
On a GPU, a decode step's host time is schedule + stage + pick + post ("host gpu" below); on
CPU it is schedule + build + pick + post ("host cpu"). Medians over the timed steps (the mean
is in the JSON). Here the host phases run right after a CPU forward has streamed the weights
through the caches, so their absolute times (most of all at 1 stream) exceed a GPU host's;
compare trees (from 2542fc0 on: graphs.stage_decode) by running both here. Not a test.

    python -m bench.host_step [--streams 1,8,64] [--steps 24] [--json out.json]
    python -m bench.host_step --profile 64      # cProfile of the host functions instead
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

from replica import graphs
from replica.config import EngineConfig
from replica.core import EngineCore
from replica.request import Request
from replica.sampling import SamplingParams

MAX_TOKENS = 4096  # never reached: the streams are cancelled after timing
PHASES = ("schedule", "build", "stage", "forward", "pick", "post")
TEXT = ("The history of the lighthouse begins with fires lit on hills to guide ships home. "
        "Later, towers of stone carried lamps of oil, then of gas, and finally electric lights "
        "turned by clockwork so that each light had its own rhythm a sailor could recognize. ")


class StageInputs:
    """What a GPU decode step does on the host instead of `build`: DecodeGraphs.accepts and key
    (with fast prefill on, as on CUDA), then the graph's input staging, into CPU tensors per
    (batch, width) bucket instead of its pinned buffers (no copies to a device)."""

    def __init__(self, core: EngineCore) -> None:
        self.graphs = graphs.DecodeGraphs(core.model, core.kv, True, core.runner.tables)
        self.block_size = core.config.block_size
        self._bufs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, record) -> None:
        if not record.chunks or not self.graphs.accepts(record):
            return
        key = b, w = self.graphs.key(record)
        bufs = self._bufs.get(key)
        if bufs is None:
            bufs = self._bufs[key] = (torch.zeros(3, b, dtype=torch.int64),
                                      torch.zeros(b + b * w, dtype=torch.int32))
        graphs.stage_decode(record, self.block_size, self.graphs.tables, *bufs)


class PhaseClock:
    """Wraps the core's schedule/build/forward/collect/launch on the instances and times them,
    until close()."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.now: dict[str, float] = defaultdict(float)
        runner = core.runner
        stage = StageInputs(core)
        schedule, build, forward, pick, launch = (core.scheduler.schedule, runner.build,
                                                  runner.model.forward, runner.collect,
                                                  runner.launch)

        def timed_schedule():
            t0 = time.perf_counter()
            record = schedule()
            t1 = time.perf_counter()
            stage(record)
            self.now["schedule"] += t1 - t0
            self.now["stage"] += time.perf_counter() - t1
            return record

        def timed(name, fn):
            def call(*args):
                t0 = time.perf_counter()
                out = fn(*args)
                self.now[name] += time.perf_counter() - t0
                return out
            return call

        targets = ((core.scheduler, "schedule"), (runner, "build"), (runner.model, "forward"),
                   (runner, "collect"), (runner, "launch"))
        self._saved = [(obj, name, vars(obj).get(name)) for obj, name in targets]
        core.scheduler.schedule = timed_schedule
        runner.build = timed("build", build)
        runner.model.forward = timed("forward", forward)
        runner.collect = timed("pick", pick)
        runner.launch = timed("launch", launch)

    def close(self) -> None:
        for obj, name, before in self._saved:
            if before is None:
                delattr(obj, name)  # the class's method shows through again
            else:
                setattr(obj, name, before)

    def step(self) -> dict[str, float]:
        """One core.step(); → seconds per phase."""
        self.now.clear()
        t0 = time.perf_counter()
        self.core.step()
        total = time.perf_counter() - t0 - self.now["stage"]
        ph = {k: self.now[k] for k in ("schedule", "build", "stage", "pick")}
        # the device's work: the forward and, on this path, the greedy argmax outside it
        ph["forward"] = self.now["launch"] - self.now["build"]
        ph["post"] = total - self.now["schedule"] - self.now["launch"] - self.now["pick"]
        return ph


def start_streams(core: EngineCore, n: int, prompt_tokens: int, stop: tuple[str, ...],
                  temperature: float) -> list:
    """Add n distinct requests of prompt_tokens tokens each and step until every one decodes;
    → the list their events go to."""
    base = core.tokenizer.encode(TEXT * (1 + prompt_tokens // 40))
    events: list = []
    for i in range(n):
        tail = core.tokenizer.encode(f" Story number {i}:")
        ids = (base[: max(1, prompt_tokens - len(tail))] + tail)[:prompt_tokens]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=i,
                                stop=stop, ignore_eos=True)
        req = Request(prompt_token_ids=tuple(ids), params=params, request_id=f"host-{n}-{i}")
        core.add(core.prepare(req), events.append)
    running = core.scheduler.running
    while len(running) < n or any(s.num_tokens - s.num_computed > 1 for s in running):
        core.step()
    return events


def run_streams(core: EngineCore, n: int, steps: int, warm: int, prompt_tokens: int,
                stop: tuple[str, ...], temperature: float) -> dict:
    """Prefill n streams, decode `warm` steps, then time `steps` decode steps."""
    events = start_streams(core, n, prompt_tokens, stop, temperature)
    sched = core.scheduler
    clock = PhaseClock(core)
    for _ in range(warm):
        clock.step()
    samples = [clock.step() for _ in range(steps)]
    clock.close()
    assert len(sched.running) == n, "a stream finished inside the timed steps"
    for s in list(sched.running):
        core.abort(s.request_id)
    del events
    row = {"streams": n, "steps": steps}
    for k in PHASES:
        xs = [p[k] * 1e6 for p in samples]
        row[k] = statistics.median(xs)
        row[k + "_mean"] = statistics.fmean(xs)
    row["host_gpu"] = sum(row[k] for k in ("schedule", "stage", "pick", "post"))
    row["host_cpu"] = sum(row[k] for k in ("schedule", "build", "pick", "post"))
    return row


def print_table(rows: list[dict]) -> None:
    cols = PHASES + ("host_gpu", "host_cpu")
    print(f"{'streams':>7} " + " ".join(f"{c:>16}" for c in cols))
    print(f"{'':>7} " + " ".join(f"{'us/step us/strm':>16}" for _ in cols))
    for r in rows:
        cells = [f"{r[c]:>8.1f} {r[c] / r['streams']:>7.1f}" for c in cols]
        print(f"{r['streams']:>7} " + " ".join(cells))


def profile(core: EngineCore, n: int, steps: int, prompt_tokens: int, stop, temperature,
            top: int = 35) -> None:
    """cProfile of `steps` decode steps of n streams (host functions by own time)."""
    import cProfile
    import pstats

    events = start_streams(core, n, prompt_tokens, stop, temperature)
    sched = core.scheduler
    for _ in range(4):
        core.step()
    prof = cProfile.Profile()
    forward = core.runner.model.forward

    def unprofiled(*args):  # the model is not host time: keep it out of the profile
        prof.disable()
        try:
            return forward(*args)
        finally:
            prof.enable()

    core.runner.model.forward = unprofiled
    clock = PhaseClock(core)  # stages the graph inputs too, on each step's own record
    prof.enable()
    for _ in range(steps):
        clock.step()
    prof.disable()
    clock.close()
    del core.runner.model.forward
    for s in list(sched.running):
        core.abort(s.request_id)
    del events
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", default="1,8,64")
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per stream count")
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--stop", action="append", default=[], help="a stop string every stream gets")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="instead of timing, cProfile decode steps of N streams")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    streams = [int(x) for x in args.streams.split(",")]
    core = EngineCore(EngineConfig(model=args.model, device="cpu", threads=args.threads,
                                   max_running_streams=max(streams + [args.profile, 1]),
                                   retain_sessions=False))
    stop = tuple(args.stop)
    if args.profile:
        profile(core, args.profile, args.steps, args.prompt_tokens, stop, args.temperature)
        return
    rows = [run_streams(core, n, args.steps, args.warm, args.prompt_tokens, stop, args.temperature)
            for n in streams]
    print(f"host time per decode step (median us over {args.steps} steps; model {args.model}, "
          f"prompt {args.prompt_tokens} tokens, stop {list(stop)}, temperature {args.temperature})")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
