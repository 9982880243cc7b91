"""CPU kernels (csrc/fedserve_cpu.c) built on first use and called through ctypes.

Why C and not torch ops: torch's CPU matmul picks different BLAS kernels by batch size (a row's
bits change when the batch crosses 16 rows), and its reductions may split work by shape. Our
kernels compute each output from its own row with an operation order fixed by the inner sizes
only, so batch invariance holds by construction; tests/kernels prove it bitwise.

The library is compiled once per source hash into a cache directory (``cache_dir()``); the
compile takes about a second. ctypes releases the GIL during each call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from kernels.linear import Linear

_SRC = Path(__file__).with_name("csrc") / "fedserve_cpu.c"
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-pthread", "-fPIC",
           "-shared", "-std=gnu11")
_FMT = {"f32": 0, "q4": 1, "q8": 2}
_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES = {
    "fs_linear": [ctypes.c_int, _P, _I, _I, _P, _P, _P, _I, _P, ctypes.c_int],
    "fs_rms_norm": [_P, _P, _I, _I, ctypes.c_float, _P, ctypes.c_int],
    "fs_silu_mul": [_P, _P, _I, _I, _I, _I, _P, ctypes.c_int],
    "fs_softmax": [_P, _I, _I, _P, ctypes.c_int],
    "fs_paged_attention": [_P, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _P, ctypes.c_float, _P,
                           ctypes.c_int],
}


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled (no C compiler, or a compiler error)."""


def cache_dir() -> Path:
    """Where compiled kernels live: $XDG_CACHE_HOME/fedserve (or ~/.cache/fedserve)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedserve" / "kernels"


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """Compile (if needed) and load the kernel library; one per process."""
    return build_library()


@functools.lru_cache(maxsize=4)
def build_library(defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernel library built with extra -D defines (the test and bench build
    -DFS_GENERIC_TILES, the portable tile, to compare it with the machine's)."""
    src = _SRC.read_bytes()
    cc = os.environ.get("CC", "cc")
    flags = _CFLAGS + tuple(f"-D{d}" for d in defines)
    tag = hashlib.sha256(src + " ".join((cc,) + flags).encode()).hexdigest()[:16]
    out = cache_dir() / f"fedserve_cpu_{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            proc = subprocess.run([cc, *flags, str(_SRC), "-o", tmp, "-lm"],
                                  capture_output=True, text=True)
        except FileNotFoundError as e:
            os.unlink(tmp)
            raise KernelBuildError(f"no C compiler ({cc}) to build {_SRC.name}") from e
        if proc.returncode != 0:
            os.unlink(tmp)
            raise KernelBuildError(f"building {_SRC.name} failed:\n{proc.stderr}")
        os.replace(tmp, out)  # atomic: concurrent builders in other processes are harmless
    lib = ctypes.CDLL(str(out))
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    return lib


_team: int | None = None  # torch's thread count, while torch_on_one_thread() holds it at one


@contextmanager
def torch_on_one_thread():
    """torch's own CPU ops on one thread for the block; these kernels keep their team (torch's
    thread count outside it). A torch op above its grain size runs as an OpenMP parallel
    region, whose threads then spin-wait for more and take the cores from these kernels' own
    thread pool. Measured on the 2-core box: EngineCore.step on the calling thread, 8 SmolLM2
    streams decoding, 51 ms a step with the step's torch ops (argmax, sampling, small tensor
    work) parallel, 31-36 ms without; a sampled stream's step 22.4 ms, 15.1 with OpenMP's
    threads passive (OMP_WAIT_POLICY=PASSIVE), 14.9-16.4 in this block (greedy 14.1-15.0). Through Engine's loop thread the greedy bench showed no difference. Nested blocks,
    or torch already on one thread: no change. Results never depend on it."""
    global _team
    n = torch.get_num_threads()
    if _team is not None or n == 1:
        yield
        return
    _team = n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _team = None


def _threads(work: int) -> int:
    """Threads for a call of `work` multiply-adds: one for small calls, where waking a team
    costs more than it saves. Results never depend on it (work is split by rows only)."""
    return 1 if work < (1 << 18) else (_team or torch.get_num_threads())


def _f32(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise TypeError(f"{name}: expected a CPU float32 tensor, got {t.dtype} on {t.device}")
    return t.contiguous()


def linear(lin: Linear, x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [n, in] f32 → [n, out] f32; each row computed alone (batch-invariant).
    lib: another build of the library (build_library), for comparisons."""
    x = _f32(x, "x")
    if x.dim() != 2 or x.shape[1] != lin.in_features:
        raise ValueError(f"x: expected [n, {lin.in_features}], got {tuple(x.shape)}")
    if lin.in_features % 32:
        raise ValueError(f"linear needs in_features % 32 == 0, got {lin.in_features}")
    y = torch.empty(x.shape[0], lin.out_features, dtype=torch.float32)
    if x.shape[0] == 0:
        return y
    wq = lin.weight if lin.fmt == "f32" else lin.qs
    scale = lin.scale.data_ptr() if lin.scale is not None else None
    minv = lin.minv.data_ptr() if lin.minv is not None else None
    (lib or library()).fs_linear(_FMT[lin.fmt], x.data_ptr(), x.shape[0], x.shape[1],
                                 wq.data_ptr(), scale, minv, lin.out_features, y.data_ptr(),
                                 _threads(x.shape[0] * lin.out_features * lin.in_features))
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., K] (K % 8 == 0)."""
    x = _f32(x, "x")
    weight = _f32(weight, "weight")
    k = x.shape[-1]
    if k % 8 or weight.shape != (k,):
        raise ValueError(f"rms_norm: last dim {k} must be a multiple of 8 and match weight")
    y = torch.empty_like(x)
    library().fs_rms_norm(x.data_ptr(), weight.data_ptr(), x.numel() // k, k, eps, y.data_ptr(),
                          _threads(x.numel() * 4))
    return y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [n, K] tensors whose rows are contiguous (strided views allowed)."""
    if gate.shape != up.shape or gate.dim() != 2:
        raise ValueError("silu_mul: gate and up must be equal [n, K]")
    for t, name in ((gate, "gate"), (up, "up")):
        if t.dtype != torch.float32 or t.stride(1) != 1:
            raise ValueError(f"silu_mul: {name} must be float32 with contiguous rows")
    out = torch.empty(gate.shape, dtype=torch.float32)
    library().fs_silu_mul(gate.data_ptr(), up.data_ptr(), gate.shape[0], gate.shape[1],
                          gate.stride(0), up.stride(0), out.data_ptr(), _threads(gate.numel() * 16))
    return out


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax of x [n, K] with a sequential sum."""
    x = _f32(x, "x")
    y = torch.empty_like(x)
    library().fs_softmax(x.data_ptr(), x.shape[0], x.shape[1], y.data_ptr(),
                         _threads(x.numel() * 16))
    return y


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, tok_row: torch.Tensor, ctx_lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of each query token over its own stream's paged KV.

    q [T, H, D]; k_cache/v_cache [num_blocks, block_size, KVH, D]; block_tables [S, MB] int32;
    tok_row [T] int32 (row of block_tables); ctx_lens [T] int32 (keys visible). → [T, H, D].
    """
    q = _f32(q, "q")
    t, h, d = q.shape
    nb, bs, kvh, d2 = k_cache.shape
    if d2 != d or d % 8 or h % kvh or v_cache.shape != k_cache.shape:
        raise ValueError("paged_attention: inconsistent q/cache shapes")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention: caches must be contiguous")
    for ten, name in ((block_tables, "block_tables"), (tok_row, "tok_row"), (ctx_lens, "ctx_lens")):
        if ten.dtype != torch.int32 or not ten.is_contiguous():
            raise ValueError(f"paged_attention: {name} must be contiguous int32")
    if tok_row.shape != (t,) or ctx_lens.shape != (t,) or block_tables.dim() != 2:
        raise ValueError("paged_attention: tok_row/ctx_lens must be [T], block_tables [S, MB]")
    if t and int(ctx_lens.max()) > block_tables.shape[1] * bs:
        raise ValueError("paged_attention: a context is longer than its block table")
    out = torch.empty_like(q)
    if t == 0:
        return out
    library().fs_paged_attention(q.data_ptr(), t, h, kvh, d, k_cache.data_ptr(),
                                 v_cache.data_ptr(), bs, block_tables.data_ptr(),
                                 block_tables.shape[1], tok_row.data_ptr(), ctx_lens.data_ptr(),
                                 scale, out.data_ptr(),
                                 _threads(int(ctx_lens.sum()) * h * d * 2))
    return out


# ---- float64 references (tests) ---------------------------------------------------------------
def paged_attention_reference(q, k_cache, v_cache, block_tables, tok_row, ctx_lens, scale):
    """float64 reference of paged_attention: gather each token's keys and attend."""
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    bs = k_cache.shape[1]
    out = torch.empty(t, h, d, dtype=torch.float64)
    for i in range(t):
        n = int(ctx_lens[i])
        pos = torch.arange(n)
        blocks = block_tables[int(tok_row[i])][pos // bs].long()
        k = k_cache[blocks, pos % bs].double().repeat_interleave(h // kvh, dim=1)  # [n, H, D]
        v = v_cache[blocks, pos % bs].double().repeat_interleave(h // kvh, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return out


def rms_norm_reference(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
