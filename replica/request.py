"""What comes into the engine (Request) and what goes out (StreamEvent), plus the incremental
detokenizer that turns a stream's output tokens into text deltas with stop-string handling."""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field

from replica.sampling import SamplingParams

_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_ids)}-{uuid.uuid4().hex[:8]}"


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
    """Output token ids → stable text; finds stop strings and truncates at the first one."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.emitted = 0  # characters of text already handed out
        self.stopped = False

    def text_of(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stable(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """(text safe to hand out, whether a stop string was hit)."""
        text = self.text_of(ids)
        hit = -1
        for s in self.stop:
            i = text.find(s)
            if i >= 0 and (hit < 0 or i < hit):
                hit = i
        if hit >= 0:
            return text[:hit], True
        if final:
            return text, False
        keep = len(text)
        while keep and text[keep - 1] == "\ufffd":  # an incomplete UTF-8 sequence
            keep -= 1
        for n in range(min(self.max_stop - 1, keep), 0, -1):  # a possible stop-string prefix
            if any(s.startswith(text[keep - n: keep]) for s in self.stop):
                keep -= n
                break
        return text[:keep], False

    def skip(self, ids: list[int]) -> None:
        """Resume: the text of `ids` was already delivered by the interrupted run."""
        self.emitted = len(self.stable(ids, final=False)[0])

    def delta(self, ids: list[int], final: bool) -> str:
        text, self.stopped = self.stable(ids, final)
        out = text[self.emitted:]
        self.emitted = max(self.emitted, len(text))
        return out
