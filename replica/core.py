"""EngineCore: the synchronous heart of a replica. step() = schedule → run → postprocess.

It is driven by one thread (Engine's loop, or a test calling step() directly). Requests are
validated and tokenized by prepare(), which touches no engine state and may run anywhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from replica.config import EngineConfig
from replica.errors import ContextLengthError, InvalidRequestError
from replica.kv import BlockPool, KVCache, SessionCache
from replica.memory import kv_pool_blocks
from replica.models.spec import LoadedModel
from replica.models.transformer import Transformer
from replica.request import Detokenizer, Request, StreamEvent, new_request_id
from replica.runner import ModelRunner
from replica.sampling import SamplingParams
from replica.scheduler import Scheduler
from replica.stream import Stream

Sink = Callable[[StreamEvent], None]
log = logging.getLogger("fedserve.engine")


@dataclass(eq=False)
class _Live:
    stream: Stream
    sink: Sink
    detok: Detokenizer | None
    sent: int = 0  # output tokens already reported in events
    pooled: torch.Tensor | None = None  # embed: running sum of final hidden states


class EngineCore:
    """One model, one KV pool, one scheduler."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        if loaded is None:
            from replica.models.registry import resolve_model

            loaded = resolve_model(config.model, config.device)
        self.config = config
        self.model_config = cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        if config.threads:
            torch.set_num_threads(config.threads)
        self.model = Transformer(cfg, loaded.weights, config.device)
        del loaded  # the model holds the weights in its own storage: free the loader's copy
        dtype = config.kv_torch_dtype
        per_block = KVCache.bytes_per_block(cfg.num_layers, config.block_size, cfg.num_kv_heads,
                                            cfg.head_dim, dtype)
        num_blocks = kv_pool_blocks(config, self.model, per_block)
        self.kv = KVCache(cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads,
                          cfg.head_dim, dtype, config.device)
        self.pool = BlockPool(num_blocks, self.kv.poison if config.poison_freed_kv else None)
        self.sessions = SessionCache(self.pool, config.block_size)
        self.scheduler = Scheduler(self.pool, self.sessions, config.block_size,
                                   config.max_running_streams, config.batch_tokens,
                                   config.retain_sessions)
        self.runner = ModelRunner(self.model, self.kv, config.use_fast_prefill)
        self._live: dict[str, _Live] = {}
        self._pieces: dict[int, str] = {}  # token id → its text alone, for every Detokenizer
        self._eos = frozenset(cfg.eos_token_ids)  # for the per-token finish check
        # events of the last step's tokens not yet delivered (overlap_events): the streams that
        # did not finish on a token id or a count; their text (and any stop string in it) is
        # worked out while the next step runs on the device
        self._overlap = config.use_overlap_events
        self._pending: list[_Live] = []
        # lookahead: the step launched ahead of its predecessor's tokens, not yet collected
        self._lookahead = config.use_lookahead
        self._ahead: tuple | None = None
        self.steps = 0
        self.tokens_computed = 0  # prompt/recompute tokens fed through the model (for tests/stats)

    # ---- requests -----------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds (all streams and retained sessions together)."""
        return self.pool.num_blocks * self.config.block_size

    @property
    def max_context(self) -> int:
        return self.model_config.max_position

    def prompt_ids(self, req: Request) -> list[int]:
        given = [x is not None for x in (req.prompt, req.prompt_token_ids, req.messages)]
        if sum(given) != 1:
            raise InvalidRequestError("give exactly one of prompt, prompt_token_ids, messages",
                                      param="prompt")
        if req.messages is not None:
            text = self.tokenizer.apply_chat_template(list(req.messages), add_generation_prompt=True)
            return self.tokenizer.encode(text)
        if req.prompt is not None:
            if not isinstance(req.prompt, str) or not req.prompt:
                raise InvalidRequestError("prompt must be a non-empty string", param="prompt")
            return self.tokenizer.encode(req.prompt)
        ids = list(req.prompt_token_ids)
        vocab = self.model_config.vocab_size
        if not ids or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab
                          for i in ids):
            raise InvalidRequestError(f"prompt token ids must be a non-empty list of ints in "
                                      f"[0, {vocab})", param="prompt")
        return ids

    def prepare(self, req: Request, embed: bool = False) -> Stream:
        """Validate and tokenize; raises typed errors. Touches no engine state."""
        ids = self.prompt_ids(req)
        if not ids:
            raise InvalidRequestError("the prompt is empty after tokenization", param="prompt")
        resume = list(req.resume_token_ids)
        params = req.params.with_seed()
        limit = self.max_context
        if len(ids) + len(resume) >= limit + (1 if embed else 0):
            raise ContextLengthError(
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{len(ids) + len(resume)}", param="messages" if req.messages else "prompt")
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit and not embed:
            raise ContextLengthError(
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{len(ids) + params.max_tokens} ({len(ids)} prompt + {params.max_tokens} "
                f"completion)", param="max_tokens")
        blocks_needed = -(-(len(ids) + len(resume) + 1) // self.config.block_size)
        if blocks_needed > self.pool.num_blocks:
            raise ContextLengthError(f"the prompt needs {blocks_needed} KV blocks; this replica "
                                     f"has {self.pool.num_blocks}", param="prompt")
        return Stream(req.request_id, ids, params, session_id=req.session_id, embed=embed,
                      output_ids=resume, num_resumed=len(resume))

    def add(self, stream: Stream, sink: Sink) -> None:
        """Admit a prepared stream; its events go to sink (called on the stepping thread)."""
        if stream.request_id in self._live:
            raise InvalidRequestError(f"duplicate request id {stream.request_id}")
        detok = None
        if not stream.embed:
            detok = Detokenizer(self.tokenizer, stream.params.stop, self._pieces)
            detok.skip(stream.output_ids)
        live = _Live(stream, sink, detok, sent=stream.num_resumed)
        self._live[stream.request_id] = live
        reason = self._finish_reason(stream) if stream.output_ids else None
        if reason:  # the resumed tokens already complete the request
            self._finish(live, reason)
            return
        self.scheduler.add(stream)

    def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            self._flush_events()  # its tokens so far, before its final event
            self._finish(live, "cancelled")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._ahead is not None

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> int:
        """Run one step; returns the number of tokens fed through the model. With lookahead,
        the step after it is launched before this one's tokens reach the host, when the
        scheduler can tell what it is (Scheduler.schedule_ahead): the device goes on while
        the host turns this step's picks into events."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            record, launched = ahead
        else:
            record = self.scheduler.schedule()
            if record.exhausted or not record.chunks:
                self._flush_events()
            for s in record.exhausted:
                self._finish(self._live[s.request_id], "length")
            if not record.chunks:
                return 0
            launched = self.runner.launch(record)
        if self._lookahead:
            self._ahead = self._launch_ahead(record, launched)
        # the last step's events go out while this one runs on the device (runner.while_running
        # is called before the host waits on it)
        self.runner.while_running = self._flush_events if self._pending else None
        try:
            out = self.runner.collect(launched)
        finally:
            self.runner.while_running = None
        self._flush_events()
        self.steps += 1
        self.tokens_computed += record.num_tokens
        tokens, lives = out.tokens, self._live
        for r, chunk in enumerate(record.chunks):
            s = chunk.stream
            if s.finished:  # it ended (a stop string, a cancel) while this step ran: row dropped
                continue
            s.num_computed = chunk.end
            live = lives[s.request_id]
            if s.embed:
                self._pool_hidden(live, out.hidden[r])
                continue
            if chunk.samples:
                s.output_ids.append(tokens[r])
                self._emit(live, defer=self._overlap)
        return record.num_tokens

    def _launch_ahead(self, record, launched):
        """(the next step, launched) when it can start before `record`'s tokens are known
        (they are picked on the device, sampled streams' too), those streams whose token from
        `record` ends them by count left out. None when the scheduler cannot tell the step."""
        limit = self.max_context

        def continues(s: Stream) -> bool:
            m = s.params.max_tokens
            return (m is None or len(s.output_ids) + 1 < m) and s.num_tokens + 1 < limit

        nxt = self.scheduler.schedule_ahead(record, continues)
        return None if nxt is None else (nxt, self.runner.launch(nxt, feed=launched))

    def idle(self) -> bool:
        """Work for a quiet engine (no stream, nothing scheduled ahead): capture one decode
        graph that steps replayed padded into a larger one (replica/graphs.py). → whether it
        did anything."""
        graphs = self.runner.graphs
        return graphs is not None and not self.has_work and graphs.capture_missed()

    def _pool_hidden(self, live: _Live, hidden: torch.Tensor) -> None:
        acc = live.pooled if live.pooled is not None else torch.zeros(hidden.shape[1])
        for row in hidden:  # sequential, in position order: invariant to chunking
            acc = acc + row
        live.pooled = acc
        s = live.stream
        if s.num_computed == s.num_tokens:
            mean = acc.to(torch.float64) / s.num_tokens
            vec = (mean / mean.norm().clamp_min(1e-12)).to(torch.float32)
            self._deliver(live, StreamEvent(s.request_id, "", (), True, "stop", s.num_tokens, 0, 0,
                                            embedding=tuple(vec.tolist())))
            self._release(live)

    def _finish_reason(self, s: Stream) -> str | None:
        p, out = s.params, s.output_ids
        last = out[-1]
        if (not p.ignore_eos and last in self._eos) or last in p.stop_token_ids:
            return "stop"
        if p.max_tokens is not None and len(out) >= p.max_tokens:
            return "length"
        if s.num_tokens >= self.max_context:
            return "length"
        return None

    def _emit(self, live: _Live, defer: bool = False) -> None:
        """The stream's new token: its event now, or (defer, and the token ends nothing by its
        id or count) at the next _flush_events."""
        reason = self._finish_reason(live.stream)
        if defer and reason is None:
            self._pending.append(live)
            return
        self._emit_text(live, reason)

    def _flush_events(self) -> None:
        """Deliver the deferred events, in the order their tokens came (a stream that a stop
        string ends here finishes now; one that ended since has nothing left to say)."""
        pending, self._pending = self._pending, []
        for live in pending:
            if not live.stream.finished:
                self._emit_text(live, None)

    def _emit_text(self, live: _Live, reason: str | None) -> None:
        s = live.stream
        text = live.detok.delta(s.output_ids, final=reason is not None)
        if live.detok.stopped:
            reason = "stop"
        if reason:
            self._finish(live, reason, text)
            return
        self._send(live, text, finished=False, reason=None)

    def _send(self, live: _Live, text: str, finished: bool, reason: str | None,
              error: Exception | None = None) -> None:
        s = live.stream
        new = tuple(s.output_ids[live.sent:])
        live.sent = len(s.output_ids)
        self._deliver(live, StreamEvent(s.request_id, text, new, finished, reason,
                                        len(s.prompt_ids), s.num_generated, s.num_cached,
                                        error=error))

    def _deliver(self, live: _Live, ev: StreamEvent) -> None:
        """Hand an event to its sink. A sink that fails (its client is gone) loses its own
        request, never the step loop or any other stream."""
        try:
            live.sink(ev)
        except Exception:  # noqa: BLE001 - whatever a consumer does wrong stays with it
            log.warning("dropping request %s: its event sink failed", ev.request_id, exc_info=True)
            s = live.stream
            if not s.finished:
                s.finish_reason = "cancelled"
                self._release(live)

    def _finish(self, live: _Live, reason: str, text: str = "") -> None:
        live.stream.finish_reason = reason
        self._send(live, text, finished=True, reason=reason)
        self._release(live)

    def _release(self, live: _Live) -> None:
        s = live.stream
        if s.finish_reason is None:
            s.finish_reason = "stop"
        self.scheduler.finish(s)
        self._live.pop(s.request_id, None)

    def fail_all(self, error: Exception) -> None:
        """The loop is dying: every live request gets a final error event."""
        self._pending.clear()
        self._ahead = None
        for live in list(self._live.values()):
            live.stream.finish_reason = "error"
            try:
                self._send(live, "", True, "error", error)
            finally:
                self._live.pop(live.stream.request_id, None)

    # ---- introspection ------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def stats(self) -> dict:
        return {
            "active_streams": len(self.scheduler.running),
            "waiting_streams": len(self.scheduler.waiting),
            "free_kv_blocks": self.pool.num_free,
            "total_kv_blocks": self.pool.num_blocks,
            "resident_sessions": self.sessions.keys(),
            "resident_retained_at": self.sessions.retained_at(),
            "max_running_streams": self.config.max_running_streams,
            "kv_capacity_tokens": self.kv_capacity_tokens,
        }


def embed_request(text: str) -> Request:
    return Request(prompt=text, params=SamplingParams(max_tokens=1, temperature=0.0),
                   request_id=new_request_id())
