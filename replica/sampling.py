"""Sampling parameters and the samplers.

A stream's randomness depends only on (seed, position): the uniform draw for the token at
position p comes from a generator seeded from (seed, p). Seeded sampling is therefore
reproducible in any batch, after preemption and after a resume.

`pick` chooses a step's tokens where its logits are (the engine's path: on CUDA the logits never
cross to the host, and a sampled stream's token can feed the next step on the device); `sample`
is one stream's token on the host, written for reading: the reference `pick` is tested
against. On a device `pick` runs `sample`'s operations on all rows at once; on the CPU it sorts
only the part of the order a row's top-k / top-p cut reads (`_draw`), with the same tokens.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kernels.cpu import torch_on_one_thread
from replica.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """vLLM-shaped sampling parameters (temperature 0 = greedy)."""

    max_tokens: int | None = 16  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))  # normalize a single stop string
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool)
                                            or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}",
                                      param="max_tokens")
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature!r}",
                                      param="temperature")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 or positive, got {self.top_k!r}",
                                      param="top_k")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", param="seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be non-empty strings", param="stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self) -> "SamplingParams":
        """A copy with a concrete seed (drawn now if none was given) so replays match."""
        if self.seed is not None or self.greedy:
            return self
        seed = int.from_bytes(os.urandom(8), "little") >> 1
        return SamplingParams(self.max_tokens, self.temperature, self.top_p, self.top_k, seed,
                              self.stop, self.stop_token_ids, self.ignore_eos)


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator for the token sampled at `position` of a stream seeded with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def uniform(seed: int | None, position: int) -> float:
    """The uniform draw in [0, 1) for the token at `position` of a stream seeded with `seed`."""
    return float(torch.rand(1, generator=position_generator(seed, position), dtype=torch.float64))


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Pick the token at `position` from one stream's logits [vocab] (float32).

    Runs per stream, so the result depends only on this stream's logits and (seed, position).
    Tokens are ordered by their logits (a stable sort: ties by token id). Softmax is monotone,
    so their probabilities come out non-increasing (two logits whose probabilities round equal
    keep the logits' order), and sorting the float32 logits moves half the bytes of sorting the
    float64 probabilities.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.to(torch.float64) / params.temperature, dim=-1)  # [V]
    order = torch.sort(logits, descending=True, stable=True).indices  # [V], ties by token id
    probs = probs[order]  # most likely first (the order of the logits is the order of the probs)
    keep = probs.numel()
    if params.top_k > 0:
        keep = min(keep, params.top_k)
    if params.top_p < 1.0:
        cum = torch.cumsum(probs, dim=-1)
        # smallest prefix whose mass reaches top_p (always at least one token)
        keep = min(keep, int(torch.searchsorted(cum, torch.tensor([params.top_p],
                                                dtype=torch.float64))) + 1)
    probs = probs[:keep]
    cum = torch.cumsum(probs, dim=-1)
    u = torch.tensor([uniform(params.seed, position)], dtype=torch.float64)
    idx = int(torch.searchsorted(cum, u * cum[-1], right=True).clamp(max=keep - 1))
    return int(order[idx])


PREFIX = 256  # the sorted prefix a top-p row tries first (grown 4x until it holds the nucleus)


def _sorted_prefix(logits: torch.Tensor, probs: torch.Tensor, params: SamplingParams
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [V] float32 and their probs [V] float64 → (probs, token ids, cumulative mass) of
    `sample`'s order, [M] each: the whole order when params cut nothing (top-p 1, top-k 0),
    else a prefix long enough for the cut. The prefix is the order's own: every token whose
    logit is >= the k-th largest, in id order, stably sorted (a tie across the boundary is taken
    whole), and its cumulative mass is the same sequential sum."""
    v = probs.numel()
    if params.top_k <= 0 and params.top_p >= 1.0:
        ids = torch.sort(logits, descending=True, stable=True).indices
        head = probs[ids]
        return head, ids, torch.cumsum(head, dim=-1)
    k = min(v, params.top_k if params.top_k > 0 else PREFIX)
    while True:
        last = torch.topk(logits, k, sorted=False).values.min()  # the k-th largest
        ids = torch.nonzero(logits >= last).squeeze(1)  # [M >= k], ascending
        ids = ids[torch.sort(logits[ids], descending=True, stable=True).indices]
        head = probs[ids]
        cum = torch.cumsum(head, dim=-1)
        if (ids.numel() == v or (params.top_k > 0 and ids.numel() >= params.top_k)
                or float(cum[-1]) >= params.top_p):
            return head, ids, cum
        k = min(v, 4 * k)


def _draw(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """`sample`'s token for one sampled row (logits [V] fp32 on the CPU), sorting only the
    prefix of the order its top-k / top-p cut reads (tests/replica/test_sampling.py holds it to
    `sample`)."""
    probs = torch.softmax(logits.to(torch.float64) / params.temperature, dim=-1)  # [V]
    _, ids, cum = _sorted_prefix(logits, probs, params)
    keep = probs.numel()
    if params.top_k > 0:
        keep = min(keep, params.top_k)
    if params.top_p < 1.0:  # within the prefix: it reaches top_p, or top_k is the smaller cut
        keep = min(keep, int(torch.searchsorted(cum, torch.tensor([params.top_p],
                                                dtype=torch.float64))) + 1)
    u = torch.tensor([uniform(params.seed, position)], dtype=torch.float64)
    at = int(torch.searchsorted(cum, u * cum[keep - 1], right=True).clamp(max=keep - 1))
    return int(ids[at])


def pick(logits: torch.Tensor, argmax: torch.Tensor, rows: Sequence[tuple[int, SamplingParams, int]]
         ) -> torch.Tensor:
    """A step's tokens, on the logits' device: logits [R, V] fp32, argmax [R] int64 (each row's
    greedy pick, first index on ties), rows: (row, params, position) of each sampled row.
    → [R] int64: argmax, with each sampled row replaced by `sample`'s token for it.

    On a device, all sampled rows at once: one stable descending sort of their logits, then
    `sample`'s float64 softmax, top-k and top-p cut and inverse CDF at the row's (seed,
    position) draw, one program a row (kernels/triton_sample.py `draw`: the mass is scanned
    only as far as the row's cut, no [rows, vocab] float64 tensors). The masses are summed in
    another order than on the host, so it is `sample`'s token but where a draw falls within
    rounding of a boundary.
    Every operation acts within a row, so a row's token depends on its own logits, params and
    position only, never on the other rows. On the CPU, row by row (`_draw`: `sample`'s
    token, bit for bit)."""
    if not rows:
        return argmax
    if logits.device.type == "cpu":  # row by row, most without a full sort, on this thread
        with torch_on_one_thread():  # kernels/cpu.py says why
            tokens = torch.tensor([_draw(logits[r], p, pos) for r, p, pos in rows], dtype=torch.int64)
        return argmax.index_copy(0, torch.tensor([r for r, _, _ in rows]), tokens)
    return _pick_sorted(logits, argmax, rows)


def _pick_sorted(logits: torch.Tensor, argmax: torch.Tensor,
                 rows: Sequence[tuple[int, SamplingParams, int]]) -> torch.Tensor:
    """`pick` on a device: every sampled row at once, from one sort (the interpreter tests run
    it on CPU tensors too)."""
    dev, v = logits.device, logits.shape[1]

    def staged(values: list, dtype: torch.dtype) -> torch.Tensor:
        # non_blocking: the host does not wait for the step in flight (a blocking copy would
        # synchronize the stream, and lookahead would lose its overlap)
        return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

    index = staged([r for r, _, _ in rows], torch.int64)  # [N]
    rows_logits = logits.index_select(0, index)  # [N, V] fp32
    # the rows' logits sorted most likely first (ties by token id)
    vals, order = torch.sort(rows_logits, dim=-1, descending=True, stable=True)
    temp = staged([p.temperature for _, p, _ in rows], torch.float64)  # [N]
    keep = staged([min(v, p.top_k) if p.top_k > 0 else v for _, p, _ in rows], torch.int64)
    top_p = staged([p.top_p for _, p, _ in rows], torch.float64)
    u = staged([uniform(p.seed, pos) for _, p, pos in rows], torch.float64)
    from kernels import triton_sample  # Triton only where a device runs it

    tokens = triton_sample.draw(vals, order, temp, keep, top_p, u)
    return argmax.index_copy(0, index, tokens)
