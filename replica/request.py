"""What comes into the engine (Request) and what goes out (StreamEvent), plus the incremental
detokenizer that turns a stream's output tokens into text deltas with stop-string handling."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from replica.sampling import SamplingParams

def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"  # no process-wide counter: engines share nothing


@dataclass(frozen=True)
class Request:
    """One generation request: exactly one of prompt / prompt_token_ids / messages.

    resume_token_ids: output tokens already delivered by an earlier, interrupted run; the
    engine continues after them and emits only what follows (failover by replay).
    """

    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    session_id: str | None = None
    resume_token_ids: tuple[int, ...] = ()
    request_id: str = field(default_factory=new_request_id)


@dataclass(frozen=True)
class StreamEvent:
    """A delta of one stream. token_ids are the tokens new since the last event; text is the
    text that became stable with them (held back while it may still be part of a stop string
    or an incomplete UTF-8 sequence)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    embedding: tuple[float, ...] | None = None
    error: Exception | None = None


@dataclass(frozen=True)
class RequestOutput:
    """The whole result of a finished request (Engine.generate)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int


class Detokenizer:
    """Output token ids → stable text; finds stop strings and truncates at the first one.

    Incremental: a call decodes only the tokens after the last clean boundary (a point where
    the text so far ends in a complete character), with the segment before that boundary as
    left context, and searches for stop strings only where a new one can start. So a token
    costs O(1) whatever the output's length. The text is exactly that of decoding all output
    ids at once: a decode split at a clean boundary is the concatenation of its parts
    (tests/replica/test_detokenizer.py checks it on the real tokenizer); a decoder for which
    that fails is caught (the window's context text changed) and decoded whole.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...],
                 pieces: dict[int, str] | None = None) -> None:
        """pieces: the text of single ids decoded alone, filled as they are met; detokenizers
        of one tokenizer may share it (it holds at most one entry per vocabulary id)."""
        self.tokenizer = tokenizer
        self.stop = stop
        self._pieces = {} if pieces is None else pieces
        self.max_stop = max((len(s) for s in stop), default=0)
        self.emitted = 0  # characters of text already handed out
        self.stopped = False
        # F, the text of the ids so far: F[:_len] is final (the text of ids[:_commit]) and only
        # F[_base:_len] is kept. Decoding restarts at _anchor (<= _commit); the text of
        # ids[_anchor:_commit] (_anchor_text) gives the new tokens their left context.
        self._commit = 0
        self._anchor = 0
        self._anchor_text = ""
        self._text = ""
        self._base = 0
        self._len = 0

    def text_of(self, ids: list[int]) -> str:
        if len(ids) == 1:  # a token's text alone: every step needs one (see _step)
            text = self._pieces.get(ids[0])
            if text is None:
                text = self._pieces[ids[0]] = self.tokenizer.decode(ids, skip_special_tokens=True)
            return text
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _tail(self, ids: list[int]) -> str:
        """F[_len:]: the text the tokens after _commit add."""
        window = self.text_of(ids[self._anchor:])
        if window.startswith(self._anchor_text):
            return window[len(self._anchor_text):]
        return self.text_of(ids)[self._len:]  # the context changed: decode it all

    def _step(self, ids: list[int], final: bool) -> tuple[str, int, bool]:
        """(F[emitted:end], end, stop hit): end is where the text safe to hand out ends."""
        tail = self._tail(ids)
        view = self._text + tail  # F[_base:]
        base = self._base
        hit = -1
        if self.stop:  # F[:_len] held no stop string: a new one starts after _len - max_stop
            start = max(0, self._len - self.max_stop + 1 - base)
            for s in self.stop:
                i = view.find(s, start)
                if i >= 0 and (hit < 0 or i < hit):
                    hit = i
        if hit >= 0:
            keep = hit
        else:
            keep = len(view)
            if not final:
                while keep and view[keep - 1] == "\ufffd":  # an incomplete UTF-8 sequence
                    keep -= 1
                if self.stop:  # hold a possible stop-string prefix (never before _base: _trim)
                    keep -= self._stop_prefix(view[keep - min(self.max_stop - 1, base + keep): keep])
        out = view[self.emitted - base: keep] if base + keep > self.emitted else ""
        if hit < 0 and tail and not tail.endswith("\ufffd"):
            self._anchor, self._anchor_text = self._commit, self.text_of(ids[self._commit:])
            self._commit = len(ids)
            self._text, self._len = view, self._len + len(tail)
        return out, base + keep, hit >= 0

    def _stop_prefix(self, tail: str) -> int:
        """The longest n such that tail[-n:] begins a stop string (0: none)."""
        best = 0
        for s in self.stop:
            # tail[j:] can begin s only where s[0] is; the first such j gives s's longest
            j = tail.find(s[0])
            while 0 <= j < len(tail) - best:
                if s.startswith(tail[j:]):
                    best = len(tail) - j
                    break
                j = tail.find(s[0], j + 1)
        return best

    def _trim(self) -> None:
        """Drop text that is handed out and can no longer be part of a new stop string.
        _base <= _len - (max_stop - 1) keeps every stop-prefix check above inside the view."""
        base = min(self.emitted, self._len - max(self.max_stop - 1, 0))
        if base > self._base:
            self._text = self._text[base - self._base:]
            self._base = base

    def skip(self, ids: list[int]) -> None:
        """Resume: the text of `ids` was already delivered by the interrupted run."""
        _, end, _ = self._step(ids, final=False)
        self.emitted = max(self.emitted, end)
        self._trim()

    def delta(self, ids: list[int], final: bool) -> str:
        """The text that became stable since the last call; ids are all output ids so far."""
        out, end, self.stopped = self._step(ids, final)
        self.emitted = max(self.emitted, end)
        self._trim()
        return out
