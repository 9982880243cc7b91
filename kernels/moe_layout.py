"""The experts of one MoE layer as the Triton MoE kernels read them (kernels/triton_moe.py):
stacked on a leading expert dim at load, q4 experts in kernels/q4_layout.py's block-major
layout with their K split counts fixed by the expert's shape and tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import q4_layout
from kernels.linear import Linear
from kernels.q4_layout import Q4Tile, split_count
from kernels.triton_linear import to_gpu_format, weight_args

Q4_EXPERT_TILE = Q4Tile()
# q4 expert K splits are sized for one token's top-k (≈ 8 experts): n-tiles × splits ≤ this.
# 64 (v21, H200): Qwen3-30B-A3B's gate_up and down in 2 splits each (128 gave 4 and 4): 1
# stream +5.3% at context 128, +4.4% at 2,048, 64 streams +2.0% / +3.5%; against 64, 32 (1
# and 1) loses 13.5% at 1 stream (gains 2.4% at 64), 256 (8 and 6) loses everywhere
# (bench/ab_modes.py `eprogN`)
EXPERT_PROGRAMS = 64
# ... for gate_up or down alone where set (None: EXPERT_PROGRAMS; bench/ab_modes.py `eguN`,
# `ednN`: at the 30B shape 2 / 2 beat 4 / 4, 2 / 1 and 1 / 1 at one token, v21)
GU_PROGRAMS: int | None = None
DOWN_PROGRAMS: int | None = None


@dataclass(frozen=True, eq=False)
class StackedExperts:
    """All experts of one layer stacked on a leading expert dim, in GPU storage.

    gate_up has its gate and up rows interleaved (row 2j = gate j, 2j + 1 = up j), so one GEMM
    tile yields both factors of silu(gate) * up. Per format, gu / down hold
      q4:  (qs [E, K/32, N, 16] uint8, sm [E, K/32, N, 2] fp16)  — triton_q4's layout
      q8:  (qs [E, N, K] int8, scale [E, N, K/32] fp16);   f32: (w [E, N, K], w)
    with N, K = 2*I, hidden for gu and hidden, I for down. q4 experts also carry their K split
    counts (by shape, for their tile) and the split programs' ticket counters, one per
    (slot, n-tile).
    """

    fmt: str
    num_experts: int
    hidden: int
    inter: int
    gu: tuple[torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor]
    gu_split: int = 1
    down_split: int = 1
    gu_tickets: torch.Tensor | None = None
    down_tickets: torch.Tensor | None = None
    tile: Q4Tile | None = None  # q4: the tile the splits and tickets were counted for
    # q4: the counters of the fused direct launch (kernels/triton_moe.py `_moe_fused_kernel`):
    # [0] the work claim, [1..] a slot's merged gate_up tiles, then a token's merged down tiles
    sync: torch.Tensor | None = None

    @classmethod
    def stack(cls, experts: tuple[tuple[Linear, Linear], ...], tile: Q4Tile | None = None,
              programs: int | None = None) -> "StackedExperts":
        tile = tile or Q4_EXPERT_TILE  # (read at the call: bench/ab_modes.py `etile...`,
        gp = (GU_PROGRAMS or EXPERT_PROGRAMS) if programs is None else programs  # `eprogN`,
        dp = (DOWN_PROGRAMS or EXPERT_PROGRAMS) if programs is None else programs  # `eguN`...)
        fmt = experts[0][0].fmt
        if any(x.fmt != fmt for pair in experts for x in pair):
            raise ValueError("experts must share one weight format")
        g0, d0 = experts[0]
        if g0.out_features % 2 or d0.in_features * 2 != g0.out_features:
            raise ValueError("gate_up must be [2*I, hidden] and down [hidden, I]")
        e, hidden, inter = len(experts), g0.in_features, d0.in_features
        order = torch.stack([torch.arange(inter), torch.arange(inter) + inter], 1).reshape(-1)

        def st(lins: list[Linear]) -> tuple[torch.Tensor, torch.Tensor]:
            if fmt == "q4":
                parts = [q4_layout.repacked_arrays(x) for x in lins]
            else:
                parts = [weight_args(to_gpu_format(x))[:2] for x in lins]
            return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])

        gu = st([_select_rows(g, order.to(g.device)) for g, _ in experts])
        down = st([d for _, d in experts])
        if fmt != "q4":
            return cls(fmt, e, hidden, inter, gu, down)
        dev = gu[0].device
        gs = split_count(2 * inter, hidden, tile, gp)
        ds = split_count(hidden, inter, tile, dp)
        tickets = lambda n: torch.zeros(e * _cdiv(n, tile.bn), dtype=torch.int32, device=dev)  # noqa: E731
        return cls(fmt, e, hidden, inter, gu, down, gs, ds, tickets(2 * inter), tickets(hidden),
                   tile, torch.zeros(1 + 2 * e, dtype=torch.int32, device=dev))

    @property
    def nbytes(self) -> int:
        seen = {t.data_ptr(): t for t in self.gu + self.down}
        return sum(t.numel() * t.element_size() for t in seen.values())

    def expert_nbytes(self) -> int:
        return self.nbytes // self.num_experts


def _select_rows(lin: Linear, order: torch.Tensor) -> Linear:
    """The Linear with its output rows in `order` (any storage format before GPU placement)."""
    if lin.fmt == "f32":
        return Linear.dense(lin.weight[order])
    if lin.fmt == "q8":
        return Linear.q8(lin.qs[order], lin.scale[order])
    return Linear.q4(lin.qs[order], lin.scale[order], lin.minv[order])


def inter_dtype(experts: StackedExperts) -> torch.dtype:
    """The dtype of the expert intermediate silu(gate) * up: float16 for q4/q8 experts (the
    down GEMM rounds it to fp16 anyway, so the bits are the same and its bytes half)."""
    return torch.float32 if experts.fmt == "f32" else torch.float16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
