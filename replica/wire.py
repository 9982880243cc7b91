"""The replica's wire contract: what the ingress sends across the Ray hop and what the replica
sends back. Frozen dataclasses that Ray serializes as they are, imported by both sides, so a
renamed or missing field fails where it is written, not three processes later.

The session is `session_id` everywhere (already namespaced by the tenant when it gets here).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from replica.request import Request
from replica.sampling import SamplingParams


@dataclass(frozen=True)
class Reach:
    """Which replica a call may land on: the router skips `avoid` (replica ids) unless no other
    replica is left. Admin calls (stats, integrity, stop) pass it to reach each replica in turn."""

    avoid: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerateCall:
    """One attempt at a generation request. Exactly one of prompt / prompt_token_ids / messages."""

    request_id: str
    params: dict  # SamplingParams fields, validated on the replica
    session_id: str | None = None
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    resume_token_ids: tuple[int, ...] = ()  # tokens already streamed to the client (failover)
    avoid: tuple[str, ...] = ()  # replicas lost under earlier attempts

    def retry(self, attempt: int, emitted: list[int], dead: list[str]) -> "GenerateCall":
        """The call for attempt `attempt`: resume after `emitted`, away from `dead`."""
        base = self.request_id.rsplit("#", 1)[0]
        return replace(self, request_id=f"{base}#{attempt}", resume_token_ids=tuple(emitted),
                       avoid=tuple(dead))

    def to_request(self) -> Request:
        """The engine's Request (raises the engine's typed errors on bad values)."""
        return Request(prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                       messages=self.messages, params=SamplingParams(**self.params),
                       session_id=self.session_id, resume_token_ids=self.resume_token_ids,
                       request_id=self.request_id)


@dataclass(frozen=True)
class TokenEvent:
    """New text and token ids of one stream, as the replica produced them."""

    replica: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class ErrorEvent:
    """A request that failed on the replica. `code` names the error kind (replica/errors.py);
    the HTTP edge maps it to a status (federation/openai_api.py)."""

    code: str
    message: str
    param: str | None = None
    replica: str = ""


@dataclass(frozen=True)
class EmbedResult:
    replica: str
    vectors: list[list[float]]
    prompt_tokens: int


def call_routing(arg) -> tuple[str | None, tuple[str, ...]]:
    """(session_id, avoid) of a call's first argument, for routers."""
    if isinstance(arg, GenerateCall):
        return arg.session_id, arg.avoid
    if isinstance(arg, Reach):
        return None, arg.avoid
    return None, ()
