"""A harness that drives EngineCore through a schedule of joins, cancellations and finishes,
checking isolation (KV of continuing streams never changes) and integrity at every step."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch

from replica.config import EngineConfig
from replica.core import EngineCore
from replica.models.synthetic import synthetic_model
from replica.request import Request
from replica.sampling import SamplingParams


FRESH_PRESETS = {"qwen3-30b-a3b-int4"}  # drawn per call, never cached (loaded says why)


@functools.lru_cache(maxsize=None)
def _cached(preset: str, device: str):
    return synthetic_model(preset, seed=7, device=device)


def loaded(preset: str, device: str = "cpu"):
    """The preset's synthetic weights (seed 7), cached per process, except the 30B preset: it
    is drawn afresh each time (~6 s on the device) and never held between tests, since one
    cached copy (21 GB) beside an engine's prepared copy (18 GB) and a 20 GB pool, plus
    another test file's cached copy, ran an 80 GB H100 out of memory."""
    if preset in FRESH_PRESETS:
        return synthetic_model(preset, seed=7, device=device)
    return _cached(preset, device)


@dataclass(frozen=True)
class StreamSpec:
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    arrival: int = 0  # step at which it joins
    cancel_after: int | None = None  # steps after arrival at which it is cancelled

    def request(self, rid: str) -> Request:
        params = SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature,
                                top_p=self.top_p, top_k=self.top_k, seed=self.seed, ignore_eos=True)
        return Request(prompt_token_ids=self.prompt, params=params, request_id=rid)


def kv_digest(core: EngineCore, stream, n: int) -> str:
    """Digest of the K/V bits at the stream's first n positions, across all layers."""
    bs = core.config.block_size
    slots = torch.tensor([stream.block_table[p // bs] * bs + p % bs for p in range(n)],
                         dtype=torch.long)
    h = hashlib.blake2b(digest_size=16)
    for kc, vc in zip(core.kv.k, core.kv.v):
        for t in (kc, vc):
            rows = t.view(-1, *t.shape[2:])[slots.to(t.device)].contiguous()
            h.update(rows.view(torch.uint8).cpu().numpy().tobytes())  # the bits, any dtype
    return h.hexdigest()


def record_logits(core: EngineCore) -> dict[str, list[tuple[int, str]]]:
    """Wrap the core's runner to log, per request, (position, digest of the logits' bits) of
    every sampled position (rows of streams that finished before their step ended are dropped
    by the core, and here). Tokens can agree while logits differ; bits cannot. The logits are
    copied on the device as each step is launched: a decode graph's buffer is rewritten by the
    next launch, which lookahead makes before this step is collected. unlog undoes it."""
    log: dict[str, list[tuple[int, str]]] = {}
    launch, collect = core.runner.launch, core.runner.collect

    def kept(record, feed=None):
        out = launch(record, feed)
        if out.logits is not None:
            out.logits = out.logits.clone()
        return out

    def logged(launched):
        out = collect(launched)
        record = launched.record
        for r, chunk in enumerate(record.chunks):
            if r in out.logits and not chunk.stream.finished:
                bits = out.logits[r].contiguous().numpy().tobytes()
                log.setdefault(chunk.stream.request_id, []).append(
                    (chunk.end, hashlib.blake2b(bits, digest_size=16).hexdigest()))
        return out

    core.runner.launch, core.runner.collect = kept, logged
    return log


def unlog(core: EngineCore) -> None:
    """Undo record_logits: the class's methods show through again."""
    core.runner.__dict__.pop("launch", None)
    core.runner.__dict__.pop("collect", None)


def run_solo(core: EngineCore, spec: StreamSpec) -> tuple[list[int], list[tuple[int, str]]]:
    """(tokens, logit digests) of spec running alone."""
    events = []
    log = record_logits(core)
    try:
        core.add(core.prepare(spec.request("solo")), events.append)
        while core.has_work:
            core.step()
    finally:
        unlog(core)
    assert events[-1].finished
    return [t for ev in events for t in ev.token_ids], log.get("solo", [])


def run_schedule(core: EngineCore, specs: list[StreamSpec], check_kv: bool = True,
                 ) -> tuple[dict[int, list[int]], dict[int, list[tuple[int, str]]]]:
    """Run specs together → (index → tokens emitted, index → logit digests)."""
    out: dict[int, list[int]] = {i: [] for i in range(len(specs))}
    log = record_logits(core)
    done: set[int] = set()
    step = 0
    pending = sorted(range(len(specs)), key=lambda i: specs[i].arrival)
    try:
        while pending or core.has_work:
            while pending and specs[pending[0]].arrival <= step:
                i = pending.pop(0)

                def sink(ev, i=i):
                    out[i].extend(ev.token_ids)
                    if ev.finished:
                        done.add(i)
                core.add(core.prepare(specs[i].request(f"r{i}")), sink)
            for i, spec in enumerate(specs):
                if spec.cancel_after is not None and spec.arrival + spec.cancel_after == step and i not in done:
                    core.abort(f"r{i}")
            before = {s.request_id: (s.num_computed, s.num_preemptions, kv_digest(core, s, s.num_computed))
                      for s in core.scheduler.running} if check_kv else {}
            core.step()
            step += 1
            core.check_integrity()
            for s in core.scheduler.running:
                if s.request_id in before and before[s.request_id][1] == s.num_preemptions:
                    n, _, digest = before[s.request_id]
                    assert kv_digest(core, s, n) == digest, f"{s.request_id}: its KV changed"
            assert step < 10_000, "schedule did not finish"
    finally:
        unlog(core)
    return out, {i: log.get(f"r{i}", []) for i in range(len(specs))}


def ask(text: str) -> list[dict]:
    """A one-message chat."""
    return [{"role": "user", "content": text}]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def mid_stream_stops(text_events: list[tuple], id_events: list[tuple]) -> tuple[str, int, int]:
    """From two streams' events (tuples of (text, token ids, ...)) of a greedy probe run: a stop
    string from the middle of the first's text, and a token id of the second that first occurs
    at index >= 3 → (stop string, stop id, that index)."""
    text = "".join(e[0] for e in text_events)
    ids = [t for e in id_events for t in e[1]]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # its first time
    assert stop.strip(), text
    return stop, ids[at], at


def run_events(core: EngineCore, requests: list[Request], cancel: dict[str, int] | None = None,
        arrive: dict[str, int] | None = None) -> dict[str, list[tuple]]:
    """Step until done → request id → its events as tuples. cancel: id → the step to abort at;
    arrive: id → the step it is added at (default 0)."""
    events: dict[str, list[tuple]] = {r.request_id: [] for r in requests}
    arrive = arrive or {}
    step = 0
    left = list(requests)
    while left or core.has_work:
        for r in [r for r in left if arrive.get(r.request_id, 0) <= step]:
            left.remove(r)
            core.add(core.prepare(r), lambda ev: events[ev.request_id].append(
                (ev.text, ev.token_ids, ev.finished, ev.finish_reason, ev.completion_tokens,
                 ev.cached_tokens)))
        for rid, at in (cancel or {}).items():
            if at == step:
                core.abort(rid)
        core.step()
        core.check_integrity()
        step += 1
        assert step < 600
    return events


def small_core(loaded, **kw) -> EngineCore:
    cfg = dict(model=loaded.config.name, block_size=4, num_kv_blocks=64, max_batch_tokens=16,
               max_running_streams=16, poison_freed_kv=True)
    cfg.update(kw)
    return EngineCore(EngineConfig(**cfg), loaded=loaded)
