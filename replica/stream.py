"""One stream's state, as counters: phases are derived, never stored.

tokens = prompt_ids + output_ids; num_computed tokens have KV in the cache. A step feeds
tokens[num_computed:end]; when end == num_tokens the stream samples its next token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replica.sampling import SamplingParams


@dataclass(eq=False)
class Stream:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    session_id: str | None = None
    embed: bool = False  # an embedding request: prefill only, pooled hidden state out
    output_ids: list[int] = field(default_factory=list)
    num_resumed: int = 0  # output tokens given by resume_token_ids (not emitted again)
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens whose KV came from the session cache (this turn)
    block_table: list[int] = field(default_factory=list)
    arrival: int = 0
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building the whole list (the step loop's per-token path)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n: end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def token_at(self, i: int) -> int:
        """tokens[i], 0 <= i < num_tokens, without building the list."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def owner(self) -> str:
        return f"stream:{self.request_id}"
