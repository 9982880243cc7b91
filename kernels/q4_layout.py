"""The q4 weight layout the GPU kernels read, made at load (no Triton here: the model's weights
are placed without importing it).

The GGUF 32-blocks of a row stay intact (byte j of a block holds element j in its low nibble and
element j + 16 in its high one), but the blocks are stored block-major: qs [K/32, N, 16] uint8,
and the scale and min of each block side by side: sm [K/32, N, 2] fp16. The bytes of one block
for BN consecutive rows are then one contiguous BN*16-byte run, and one block of one row is
exactly the K = 16 operand column of two MMAs (low nibbles × x[k0:k0+16], high nibbles ×
x[k0+16:k0+32]) whose scale is a per-column broadcast (kernels/triton_q4.py).

A weight's K split count S (`split_count`) is fixed here too, from its shape and the tile only —
never from the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.linear import QBLOCK, Linear

# target CTAs for one weight at M = 1: qkv S = 4, o 8, router 16 (the split may follow the
# weight's shape only, so one value serves every batch). Against 256 (qkv 2: its 320 CTAs of
# 64 threads at 234 registers and a ring of 8, 4 an SM; at 4 splits 128 threads at ~150
# registers and a ring of 4, still one wave), H100, same call: 1 stream +1.8% at contexts 128
# and 2,048, 8 streams +1.2%, 64 streams +0.6% / -0.8%; bitwise sets 13/13 (GPU_NOTES v22).
# 512 (qkv 4, o 16) gains 2.6% at 1 stream and loses 5.5% at 64 (v22; v9 on the H200 alike)
MAX_PROGRAMS = 384
MAX_SPLIT = 16
MAX_ROWS = 8192  # rows per launch, unsplit weights
SPLIT_ROWS = 512  # rows per launch, split weights: bounds the partials (S x rows x N fp32) and
# the ticket buffer (SPLIT_ROWS / BM row tiles); prefill chunks go several launches


@dataclass(frozen=True)
class Q4Tile:
    """Tile of the q4 GEMM: BM rows × BN outputs, NB 32-blocks of K per loop step, one warp
    per program by default (the loads go straight into the MMA operand layout; see sass_report)."""

    bm: int = 16
    bn: int = 64
    nb: int = 2  # BK = 64: measured best or tied at M = 1, 8, 64 (GPU_NOTES v6)
    warps: int = 1
    stages: int = 3
    # the weights as the MMA's A operand (kernels/triton_q4.py `q4_rows` SWAP): the tile
    # computes out.T [BN, BM], so on Hopper BN = 64 weight rows make one warpgroup's wgmma
    # (each warp dequantizes its own 16 rows, once for all BM rows of x)
    swap: bool = False

    @property
    def bk(self) -> int:
        return self.nb * QBLOCK

    @classmethod
    def parse(cls, spec: str) -> "Q4Tile":
        """"16x64x64w1s3" → Q4Tile (BM x BN x BK, warps, pipeline stages; a trailing "t":
        the weights as the MMA's A operand)."""
        swap = spec.endswith("t")
        try:
            dims, _, rest = spec.removesuffix("t").partition("w")
            warps, _, stages = rest.partition("s")
            bm, bn, bk = (int(v) for v in dims.split("x"))
            tile = cls(bm, bn, bk // QBLOCK, int(warps), int(stages or 3), swap)
        except ValueError as e:
            raise ValueError(f"q4 tile {spec!r}: expected BMxBNxBKwW[sS], e.g. 16x64x64w1s3") from e
        if bk % QBLOCK or bm < 16 or bn < 16 or bk < QBLOCK:
            raise ValueError(f"q4 tile {spec!r}: BM, BN >= 16, BK a multiple of 32")
        return tile

    @property
    def name(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}w{self.warps}s{self.stages}{'t' if self.swap else ''}"


LINEAR_TILE = Q4Tile()
# Many rows (prefill, big batches): one program runs all K splits of its tile (no partials in
# memory) from SEQ_MIN_ROWS rows, and the row tile widens from WIDE_MIN_ROWS. Same bits per
# row as LINEAR_TILE with parallel splits (kernels/triton_q4.py `plan`), so the thresholds are
# free: set where each measured faster on the H200 (bench/row_modes.py, GPU_NOTES v8).
WIDE_TILE = Q4Tile(bm=32)
SEQ_MIN_ROWS = 256
WIDE_MIN_ROWS = 512
# Below SEQ_MIN_ROWS rows, from SWAP_MIN_ROWS, the split programs of weights with fewer than
# SWAP_MAX_N outputs (the router) run SWAP_TILE: the weights as the MMA's A operand, 64 of
# them by 16 rows of x on one warpgroup (Hopper: wgmma, the dequantized weights in registers,
# each warp dequantizing 16 of the 64) — the decode tile's bits (GPU test). H100, router 128 x
# 2048, µs: 1 row 5.0 against 5.9, 8 rows 4.8 / 7.1, 16 4.9 / 8.2, 64 5.1 / 8.4, 128 5.7 /
# 8.8. On qkv and o it lost (64 rows, 32-row swapped tile: 21.0 / 17.1 against 16.4 / 15.9:
# Triton loads the A bytes from shared memory one at a time and waits on every wgmma)
# (GPU_NOTES v14). SWAP_MIN_ROWS None: off
SWAP_TILE = Q4Tile(bm=16, bn=64, nb=2, warps=4, stages=3, swap=True)
SWAP_MIN_ROWS: int | None = 1
SWAP_MAX_N = 1024
# From DENSE_MIN_ROWS rows on CUDA the weight is dequantized once per call into fp16 W.T and a
# many-warp tile runs fp16 MMAs on it (kernels/triton_f16.py): the same fp16 weights, k steps,
# split ranges and merge order, so the same bits per row, and the tensor cores no longer wait
# on a one-warp dequant. Weights with fewer than DENSE_MIN_N outputs (the router) keep the q4
# tiles. H200 (GPU_NOTES v10): 64 x 128 tiles on 4 warps below DENSE_WIDE_ROWS, 128 x 128 on 8
# from it. None: off
DENSE_TILE = Q4Tile(bm=64, bn=128, nb=2, warps=4, stages=4)
DENSE_WIDE_TILE = Q4Tile(bm=128, bn=128, nb=2, warps=8, stages=4)
DENSE_MIN_ROWS: int | None = 256
DENSE_WIDE_ROWS = 1024
DENSE_MIN_N = 1024


def split_count(n: int, k: int, tile: Q4Tile, programs: int | None = None) -> int:
    """K splits for a weight [n, k]: the most (≤ MAX_SPLIT, dividing the k steps evenly) that
    keep n-tiles × splits ≤ programs (default MAX_PROGRAMS). From the weight's shape and the
    tile alone."""
    programs = MAX_PROGRAMS if programs is None else programs
    steps = _cdiv(k, tile.bk)
    n_tiles = _cdiv(n, tile.bn)
    return max(s for s in range(1, MAX_SPLIT + 1) if steps % s == 0 and n_tiles * s <= max(programs, n_tiles))


@dataclass(frozen=True, eq=False)
class Q4Linear(Linear):
    """A q4 Linear in GPU storage: qs [K/32, N, 16] uint8, sm [K/32, N, 2] fp16 (scale, min),
    its K split count and the split programs' ticket counters (zero between launches)."""

    sm: torch.Tensor | None = None
    split: int = 1
    tickets: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        o, i = self.out_features, self.in_features
        if self.fmt != "q4" or i % QBLOCK:
            raise ValueError("Q4Linear holds q4 weights with in_features % 32 == 0")
        if self.qs is None or tuple(self.qs.shape) != (i // QBLOCK, o, 16) or self.qs.dtype != torch.uint8:
            raise ValueError(f"Q4Linear.qs: expected [{i // QBLOCK}, {o}, 16] uint8")
        if self.sm is None or tuple(self.sm.shape) != (i // QBLOCK, o, 2) or self.sm.dtype != torch.float16:
            raise ValueError(f"Q4Linear.sm: expected [{i // QBLOCK}, {o}, 2] float16")
        if self.qs.numel() >= 2 ** 31:
            raise ValueError("Q4Linear: 32-bit offsets inside one weight")

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 weight [out, in] (or only `rows`), exactly as the kernel sees it."""
        qs, sm = (self.qs, self.sm) if rows is None else (self.qs[:, rows], self.sm[:, rows])
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.float32)  # [nb, n, 32]
        sm = sm.to(torch.float32)
        w = q * sm[..., :1] + sm[..., 1:]  # [nb, n, 32]
        return w.permute(1, 0, 2).reshape(w.shape[1], -1)

    def to(self, device: torch.device | str) -> "Q4Linear":
        return Q4Linear("q4", self.out_features, self.in_features, qs=self.qs.to(device),
                        sm=self.sm.to(device), split=self.split,
                        tickets=None if self.tickets is None else self.tickets.to(device))


def repack(lin: Linear, tile: Q4Tile = LINEAR_TILE, programs: int | None = None) -> Q4Linear:
    """q4 Linear (GGUF block order, fp32 scale/min) → Q4Linear. Scales and mins must fit fp16
    (GGUF's own precision: exact for Q4_0/Q4_1 and GPTQ)."""
    if isinstance(lin, Q4Linear):
        return lin
    o, i = lin.out_features, lin.in_features
    qs, sm = repacked_arrays(lin)
    split = split_count(o, i, tile, programs)
    tickets = None
    if split > 1:
        tickets = torch.zeros(SPLIT_ROWS // tile.bm * _cdiv(o, tile.bn), dtype=torch.int32,
                              device=qs.device)
    return Q4Linear("q4", o, i, qs=qs, sm=sm, split=split, tickets=tickets)


def repacked_arrays(lin: Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(qs [K/32, N, 16] uint8, sm [K/32, N, 2] fp16) of a q4 Linear in GGUF block order."""
    o, i = lin.out_features, lin.in_features
    qs = lin.qs.view(o, i // QBLOCK, 16).transpose(0, 1).contiguous()
    sm = torch.stack([lin.scale, lin.minv], dim=-1).transpose(0, 1).to(torch.float16).contiguous()
    if not torch.isfinite(sm).all():
        raise ValueError("q4 scale/min does not fit fp16 (|value| > 65504)")
    return qs, sm


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
