"""Weight-only quantized linear layers: y = x @ W.T with W kept in its storage format.

Formats (all dequantize exactly to fp32, so the kernels and the reference agree on W):
  f32  weight [out, in] float32
  q4   qs [out, in//2] uint8, scale/minv [out, in//32] float32:  w = scale * q + minv,
       q in 0..15; within each 32-block byte j holds element j (low nibble) and j+16 (high),
       the GGUF Q4_0/Q4_1 nibble order. Q4_0 (minv = -8*scale) and GPTQ sym (minv = -z*scale)
       map onto it exactly because d*q and d*z are exact in fp32 for fp16 d and 4-bit q, z.
  q8   qs [out, in] int8, scale [out, in//32] float32:  w = scale * q   (GGUF Q8_0)

Every output element y[b, j] is computed from x[b] and W[j] alone, by the same code whatever the
batch holds: that is what makes decode batch-invariant (see kernels/cpu.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QBLOCK = 32  # elements per quantization block (GGUF and our q4/q8 layouts)
FORMATS = ("f32", "q4", "q8")


@dataclass(frozen=True, eq=False)
class Linear:
    """A linear layer's weight in storage form; call it on activations [n, in] float32."""

    fmt: str
    out_features: int
    in_features: int
    weight: torch.Tensor | None = None  # f32: [out, in] float32
    qs: torch.Tensor | None = None  # q4: [out, in//2] uint8; q8: [out, in] int8
    scale: torch.Tensor | None = None  # [out, in//32] float32
    minv: torch.Tensor | None = None  # q4: [out, in//32] float32

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown linear format {self.fmt!r}")
        o, i = self.out_features, self.in_features
        if self.fmt == "f32":
            _check(self.weight, (o, i), torch.float32, "weight")
            return
        if i % QBLOCK:
            raise ValueError(f"in_features {i} is not a multiple of {QBLOCK}")
        _check(self.scale, (o, i // QBLOCK), torch.float32, "scale")
        if self.fmt == "q4":
            _check(self.qs, (o, i // 2), torch.uint8, "qs")
            _check(self.minv, (o, i // QBLOCK), torch.float32, "minv")
        else:
            _check(self.qs, (o, i), torch.int8, "qs")

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def dense(cls, w: torch.Tensor) -> "Linear":
        """From a float weight [out, in] of any float dtype (kept as fp32)."""
        w = w.detach().to(torch.float32).contiguous()
        return cls("f32", w.shape[0], w.shape[1], weight=w)

    @classmethod
    def q4(cls, qs: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor) -> "Linear":
        return cls("q4", qs.shape[0], qs.shape[1] * 2, qs=qs.contiguous(),
                   scale=scale.to(torch.float32).contiguous(),
                   minv=minv.to(torch.float32).contiguous())

    @classmethod
    def q8(cls, qs: torch.Tensor, scale: torch.Tensor) -> "Linear":
        return cls("q8", qs.shape[0], qs.shape[1], qs=qs.contiguous(),
                   scale=scale.to(torch.float32).contiguous())

    # ---- reference paths ----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return (self.weight if self.fmt == "f32" else self.qs).device

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 weight [out, in] (or only `rows`), exactly as the kernels see it."""
        if self.fmt == "f32":
            return self.weight if rows is None else self.weight[rows]
        sel = (lambda t: t) if rows is None else (lambda t: t[rows])
        scale = sel(self.scale)  # [n, in//32]
        if self.fmt == "q8":
            q = sel(self.qs).to(torch.float32).view(scale.shape[0], -1, QBLOCK)
            return (q * scale[..., None]).reshape(scale.shape[0], -1)
        packed = sel(self.qs).view(scale.shape[0], -1, QBLOCK // 2)  # [n, nb, 16]
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).to(torch.float32)  # [n, nb, 32]
        return (q * scale[..., None] + sel(self.minv)[..., None]).reshape(scale.shape[0], -1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows [len(ids), in]: the embedding lookup of a tied/untied table."""
        return self.dequantize(ids)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """float64 reference of x @ W.T, for tests."""
        return (x.to(torch.float64) @ self.dequantize().to(torch.float64).T)

    def to(self, device: torch.device | str) -> "Linear":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Linear(self.fmt, self.out_features, self.in_features, mv(self.weight),
                      mv(self.qs), mv(self.scale), mv(self.minv))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.weight, self.qs, self.scale, self.minv) if t is not None)


def _check(t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
    if t is None:
        raise ValueError(f"{name} is required")
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"{name}: expected {shape} {dtype}, got {tuple(t.shape)} {t.dtype}")


# ---- GGUF and GPTQ layouts -> ours ---------------------------------------------------------
_F16 = np.dtype("<f2")


def from_gguf(type_name: str, raw: np.ndarray, out_features: int, in_features: int) -> Linear:
    """Build a Linear from a GGUF tensor's raw data ([out, bytes_per_row] uint8 or float array).

    type_name is the ggml type name: F32, F16, BF16, Q8_0, Q4_0, Q4_1.
    """
    o, i = out_features, in_features
    if type_name in ("F32", "F16"):
        return Linear.dense(torch.from_numpy(np.ascontiguousarray(raw).reshape(o, i).astype(np.float32)))
    if type_name == "BF16":
        u16 = np.ascontiguousarray(raw).view(np.uint16).reshape(o, i).astype(np.uint32) << 16
        return Linear.dense(torch.from_numpy(u16.view(np.float32)))
    nb = i // QBLOCK
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(o, nb, -1)
    d = blocks[..., 0:2].copy().view(_F16)[..., 0].astype(np.float32)  # [o, nb]
    if type_name == "Q8_0":  # 2 bytes d, 32 int8
        qs = blocks[..., 2:34].copy().view(np.int8).reshape(o, i)
        return Linear.q8(torch.from_numpy(qs), torch.from_numpy(d))
    if type_name == "Q4_0":  # 2 bytes d, 16 bytes nibbles; w = d * (q - 8)
        qs = blocks[..., 2:18].reshape(o, i // 2)
        return Linear.q4(torch.from_numpy(qs.copy()), torch.from_numpy(d), torch.from_numpy(-8.0 * d))
    if type_name == "Q4_1":  # 2 bytes d, 2 bytes m, 16 bytes nibbles; w = d * q + m
        m = blocks[..., 2:4].copy().view(_F16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:20].reshape(o, i // 2)
        return Linear.q4(torch.from_numpy(qs.copy()), torch.from_numpy(d), torch.from_numpy(m))
    raise ValueError(f"unsupported GGUF tensor type {type_name}")


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              group_size: int = 128, zero_offset: int = 1) -> Linear:
    """GPTQ int4 (sym or asym, no act-order) → q4.

    qweight [in//8, out] int32 packs 8 nibbles along the input dim (bits 4k..4k+3 = row 8i+k);
    qzeros [in//group, out//8] int32 packs along the output dim; scales [in//group, out].
    The classic checkpoint format stores zero-1 (zero_offset=1); w = scale * (q - zero).
    """
    if group_size % QBLOCK:
        raise ValueError(f"GPTQ group size {group_size} must be a multiple of {QBLOCK}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = (qweight.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & 0xF  # [in//8, 8, out]
    q = q.reshape(-1, q.shape[-1]).T.contiguous()  # [out, in]
    z = (qzeros.to(torch.int32)[:, :, None] >> shifts[None, None, :]) & 0xF  # [G, out//8, 8]
    z = (z.reshape(z.shape[0], -1) + zero_offset).T.to(torch.float32)  # [out, G]
    s = scales.to(torch.float32).T  # [out, G]
    rep = group_size // QBLOCK
    scale = s.repeat_interleave(rep, dim=1).contiguous()  # [out, in//32]
    minv = (-(z * s)).repeat_interleave(rep, dim=1).contiguous()
    return Linear.q4(pack_q4(q), scale, minv)


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] ints 0..15 → [out, in//2] uint8 in the GGUF 32-block nibble order."""
    o, i = q.shape
    blk = q.to(torch.uint8).view(o, i // QBLOCK, QBLOCK)
    return (blk[..., :16] | (blk[..., 16:] << 4)).reshape(o, i // 2).contiguous()


def quantize_q4(w: torch.Tensor) -> Linear:
    """Round a float weight [out, in] to q4 (asymmetric, per 32-block): for tests and synthetic models."""
    o, i = w.shape
    blk = w.to(torch.float32).view(o, i // QBLOCK, QBLOCK)
    lo, hi = blk.amin(-1), blk.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8).half().float()  # fp16-representable like GGUF
    minv = lo.half().float()
    q = ((blk - minv[..., None]) / scale[..., None]).round().clamp(0, 15)
    return Linear.q4(pack_q4(q.view(o, i)), scale, minv)


def quantize_q8(w: torch.Tensor) -> Linear:
    """Round a float weight [out, in] to q8 (symmetric, per 32-block)."""
    o, i = w.shape
    blk = w.to(torch.float32).view(o, i // QBLOCK, QBLOCK)
    scale = (blk.abs().amax(-1) / 127).clamp_min(1e-8).half().float()
    q = (blk / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
    return Linear.q8(q.view(o, i), scale)


def concat_rows(parts: list[Linear]) -> Linear:
    """Stack several Linears with the same input into one (rows of W concatenated).

    Exact: every output row is computed from its own weight row, so fusing q/k/v or gate/up
    changes no bit of any output and saves one weight pass over x per fused layer.
    """
    fmt, k = parts[0].fmt, parts[0].in_features
    if any(p.fmt != fmt or p.in_features != k for p in parts):
        raise ValueError("concat_rows needs Linears of one format and input size")
    cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    if fmt == "f32":
        return Linear.dense(cat("weight"))
    if fmt == "q8":
        return Linear.q8(cat("qs"), cat("scale"))
    return Linear.q4(cat("qs"), cat("scale"), cat("minv"))
