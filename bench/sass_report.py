"""Offline SASS of the q4 linear kernel's K loop, for sm_90, on a machine without a GPU.

Triton ships ptxas and cuobjdump, so a kernel compiles to a cubin anywhere. This counts the
instructions of the innermost loop per tile config (the inline-PTX dequant, as on the GPU).
Instructions per weight predict the loop's speed without spending device time, and a loop
that stores to shared memory (STS) shows a tile where Triton did not load the raw bytes
straight into the MMA operand layout.

    python -m bench.sass_report 16x64x64w1s3 64x64x64w4s3t [--attention]
    python -m bench.sass_report --experts 16x64x64w1s3r128,16x64x64w1s2r96   # occupancy
    python -m bench.sass_report --cuda q4_egu2_d4,q4_esgu2_d4   # kernels/cuda_q4.py entries
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import q4_layout, triton_q4
from kernels.q4_layout import Q4Tile

CONSTEXPRS = ("HAS_RES", "BM", "BN", "NB", "S", "SEQ", "ASM", "PDL", "TRACE", "SWAP")
# what the runtime specializes for our shapes (multiples of 16): without it every load is scalar
DIV16 = {"x_ptr", "w_ptr", "sm_ptr", "res_ptr", "y_ptr", "ws_ptr", "tickets_ptr", "N", "K",
         "stride_x"}
_ADDR = re.compile(r"\s+/\*([0-9a-f]{4})\*/")


@dataclass(frozen=True)
class LoopReport:
    tile: Q4Tile
    total: int  # instructions in the kernel
    loop: int  # instructions in the longest backward-branch loop (the K loop)
    ops: collections.Counter

    @property
    def per_weight(self) -> float:
        return self.loop / (self.tile.bn * self.tile.bk / (32 * self.tile.warps))

    @property
    def shared_stores(self) -> int:
        return self.ops["STS"]


def _compile(kern, consts: dict, ptr_types: dict, scalar_types: dict, div16: set, arch: int,
             **options):
    """kern compiled for sm_`arch` with these constexprs; pointers default to *fp32, other
    arguments to i32; the names in div16 specialized as the runtime does for our shapes."""
    types, attrs = {}, {}
    for i, name in enumerate(kern.arg_names):
        if name in consts:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = ptr_types.get(name, "*fp32")
        else:
            types[name] = scalar_types.get(name, "i32")
        if name in div16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kern, types, consts, attrs), target=GPUTarget("cuda", arch, 32),
                          options=options)


def compile_q4_linear(tile: Q4Tile, arch: int = 90, split: int = 1, pdl: bool = False,
                      seq: bool = False):
    consts = dict(HAS_RES=False, BM=tile.bm, BN=tile.bn, NB=tile.nb, S=split, SEQ=seq, ASM=True,
                  PDL=pdl, TRACE=False, SWAP=tile.swap, EVEN=triton_q4.EVEN_STEPS)  # (30B: even)
    return _compile(triton_q4._q4_linear_kernel, consts,
                    {"w_ptr": "*u8", "sm_ptr": "*fp16", "tickets_ptr": "*i32", "trace_ptr": "*i64"},
                    {}, DIV16, arch, num_warps=tile.warps, num_stages=tile.stages, launch_pdl=pdl)


def compile_attention(arch: int = 90):
    """The paged attention split kernel as the engine launches it on a bf16 pool (Qwen3-30B-A3B
    heads: 32 query, 4 KV, head_dim 128, 16-token blocks)."""
    from kernels import triton_attention as ta

    consts = dict(H=32, KVH=4, D=128, BS=16, GROUP=8, GROUP_PAD=16, SPLIT=ta.SPLIT,
                  BLOCK_N=ta.BLOCK_N_BF16, PREC=ta.PRECISION, MMA=True, PDL=True, HS=1,
                  LINES=0, TRACE=False, PROBE=0)  # (as launched above PREFETCH_KV tokens)
    ptrs = {"k_ptr": "*bf16", "v_ptr": "*bf16", "bt_ptr": "*i32", "row_ptr": "*i32", "ctx_ptr": "*i32"}
    div16 = {"q_ptr", "k_ptr", "v_ptr", "bt_ptr", "out_ptr", "pacc_ptr", "pml_ptr", "stride_bt"}
    return _compile(ta._attn_split_kernel, consts, ptrs, {"scale": "fp32"}, div16, arch,
                    num_warps=ta.WARPS, num_stages=ta.STAGES, launch_pdl=True)


def compile_expert(kind: str, tile: Q4Tile, maxnreg: int | None, arch: int = 90,
                   direct: bool = False):
    """The q4 expert kernel `kind` ("gate_up" or "down") of the 30B preset's experts as the
    engine launches it from SEQ_MIN_TOKENS grouped tokens: one program runs all K splits (SEQ),
    `tile`'s warps and stages, registers capped at maxnreg (None: the compiler's choice).
    direct: as launched up to DIRECT_MAX_TOKENS tokens instead (split programs, a slot an
    assignment; down prefetches its weights into L2 before the wait)."""
    from kernels import moe_layout, triton_moe

    hidden, inter = 2048, 768
    n, k = (2 * inter, hidden) if kind == "gate_up" else (hidden, inter)
    consts = dict(FMT=triton_moe.FMT_CODES["q4"], BM=tile.bm, BN=tile.bn, BK=tile.bk,
                  S=q4_layout.split_count(n, k, tile, moe_layout.EXPERT_PROGRAMS), SEQ=not direct,
                  DIRECT=direct, ASM=True, PDL=True, FLAT=0,
                  PREFETCH=(triton_moe.PREFETCH_BLOCKS or 0) if direct else 0,
                  EVEN=triton_q4.EVEN_STEPS and triton_q4.even(n, k, tile.bn, tile.nb))
    if kind == "gate_up":
        kern = triton_moe._moe_gate_up_kernel
        consts = {k: v for k, v in consts.items() if k != "PREFETCH"} | dict(TOPK=8)
        ptrs = {"x_ptr": "*fp32", "meta_ptr": "*i32", "arows_ptr": "*i32", "w_ptr": "*u8",
                "s_ptr": "*fp16", "inter_ptr": "*fp16", "ws_ptr": "*fp32", "tickets_ptr": "*i32"}
    else:
        kern = triton_moe._moe_down_kernel
        ptrs = {"inter_ptr": "*fp32" if triton_moe.INTER_F32 else "*fp16", "meta_ptr": "*i32",
                "arows_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*fp16", "y_ptr": "*fp32",
                "ws_ptr": "*fp32", "tickets_ptr": "*i32"}
    # what the runtime specializes for these shapes: every pointer and every integer argument
    # outside do_not_specialize (T, TK) is a multiple of 16 — K and I among them, without which
    # Triton does not pipeline the K loop (no cp.async)
    div16 = {name for name in kern.arg_names if name not in consts and name not in ("T", "TK")}
    options = dict(num_warps=tile.warps, num_stages=tile.stages, launch_pdl=True)
    if maxnreg:
        options["maxnreg"] = maxnreg
    return _compile(kern, consts, ptrs, {}, div16, arch, **options)


def occupancy(cubin: bytes, shared: int, warps: int) -> tuple[int, int, int]:
    """(registers, shared bytes, warps an SM) of a kernel on sm_90: 64 K registers, 228 KB of
    shared memory (1 KB of it reserved a block), at most 32 blocks and 64 warps an SM."""
    regs = registers(cubin)
    by_regs = 65536 // (max(regs, 1) * 32 * warps)
    by_smem = 233472 // (shared + 1024) if shared else 32
    return regs, shared, min(by_regs, by_smem, 32, 64 // warps) * warps


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool("cuobjdump"), *flags, f.name], capture_output=True, text=True,
                              check=True).stdout


def cuda_cubin(part: str) -> bytes:
    """kernels/cuda_q4.py's module `part` (core / extra) for sm_90: NVRTC's PTX through ptxas."""
    from kernels import cuda_q4

    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "m.ptx"), os.path.join(d, "m.cubin")
        with open(src, "wb") as f:
            f.write(cuda_q4.ptx("compute_90", part=part))
        subprocess.run([_tool("ptxas"), "-arch=sm_90", src, "-o", out], check=True)
        with open(out, "rb") as f:
            return f.read()


def sass(cubin: bytes) -> str:
    return _cuobjdump(cubin, "-sass")


def registers(cubin: bytes) -> int:
    return int(re.search(r"REG:(\d+)", _cuobjdump(cubin, "-res-usage")).group(1))


def loop_report(tile: Q4Tile) -> LoopReport:
    return _mma_loop(tile, sass(compile_q4_linear(tile).asm["cubin"]))


def _mma_loop(tile, text: str) -> LoopReport:
    """The innermost loop holding the MMAs of one kernel's SASS `text`: its instructions by op."""
    lines = [ln for ln in text.splitlines() if _ADDR.match(ln)]
    addr = [int(_ADDR.match(ln).group(1), 16) for ln in lines]
    spans = []  # backward branches: (target, branch) address ranges
    for a, ln in zip(addr, lines):
        m = re.search(r"BRA\s+0x([0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < a:
            spans.append((int(m.group(1), 16), a))
    # the K loop: the innermost loop that holds the MMAs
    mma = [a for a, ln in zip(addr, lines) if "HMMA" in ln or "HGMMA" in ln]
    loops = [sp for sp in spans if any(sp[0] <= a <= sp[1] for a in mma)]
    span = min(loops, key=lambda sp: sp[1] - sp[0]) if loops else (0, -1)
    ops: collections.Counter = collections.Counter()
    body = [ln for a, ln in zip(addr, lines) if span[0] <= a <= span[1]]
    for ln in body:
        m = re.search(r"\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", ln)
        if m:
            op = m.group(2)
            ops[op if op.startswith(("LDG", "IMAD.MOV")) else op.split(".")[0]] += 1
    return LoopReport(tile, len(lines), len(body), ops)


def cuda_reports(entries: list[str]) -> dict[str, tuple[LoopReport, int]]:
    """{entry: (its MMA loop's report, registers)} for kernels/cuda_q4.py entries (either module)."""
    from kernels import cuda_q4

    out = {}
    for part, names in (("core", cuda_q4.ENTRIES), ("extra", cuda_q4.EXTRA_ENTRIES)):
        mine = [e for e in entries if e.encode() in names]
        if not mine:
            continue
        cubin = cuda_cubin(part)
        for e in mine:
            regs = int(re.search(r"REG:(\d+)", _cuobjdump(cubin, "-res-usage", "-fun", e)).group(1))
            out[e] = (_mma_loop(None, _cuobjdump(cubin, "-sass", "-fun", e)), regs)
    missing = set(entries) - set(out)
    if missing:
        raise SystemExit(f"no such cuda_q4 entries: {sorted(missing)}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tiles", nargs="*",
                    help="q4 decode tiles (default: the engine's, unless another report is asked)")
    ap.add_argument("--attention", action="store_true",
                    help="also the paged attention split kernel: instructions, cp.async, registers")
    ap.add_argument("--experts", default="",
                    help="expert kernels' registers, shared memory and warps an SM for these "
                         "tiles, each optionally ending rN (a register cap), e.g. "
                         "16x64x64w1s3r128,16x64x64w1s2r96")
    ap.add_argument("--cuda", default="",
                    help="kernels/cuda_q4.py entries (comma-separated): the MMA loop's "
                         "instructions by op, and registers")
    args = ap.parse_args()
    for e, (r, regs) in cuda_reports([e for e in args.cuda.split(",") if e]).items():
        moves = sum(r.ops[o] for o in ("IMAD.MOV.U32", "MOV", "CS2R"))
        ldg = sum(c for o, c in r.ops.items() if o.startswith("LDG"))
        print(f"{e}: kernel {r.total} instructions, {regs} registers; MMA loop {r.loop} "
              f"(HMMA {r.ops['HMMA']}, LDG {ldg}, IMAD/MOV/CS2R {moves})")
        print("    " + ", ".join(f"{o} {c}" for o, c in r.ops.most_common(12)))
    for spec in [t for t in args.experts.split(",") if t]:
        tile = Q4Tile.parse(spec.split("r")[0])
        cap = int(spec.split("r")[1]) if "r" in spec else None
        for kind in ("gate_up", "down"):
            kern = compile_expert(kind, tile, cap)
            cubin = kern.asm["cubin"]
            regs, shared, warps = occupancy(cubin, kern.metadata.shared, tile.warps)
            spills = sum(" STL" in ln for ln in sass(cubin).splitlines())  # local-memory stores
            print(f"{kind:<8} {spec:<20} {regs:>4} registers {shared:>7} B shared  "
                  f"{warps:>3} warps an SM  {spills} spill stores")
    if args.attention:
        cubin = compile_attention().asm["cubin"]
        lines = [ln for ln in sass(cubin).splitlines() if _ADDR.match(ln)]
        print(f"paged attention (bf16 KV): kernel {len(lines)} instructions, "
              f"{sum('LDGSTS' in ln for ln in lines)} LDGSTS, {registers(cubin)} registers")
    tiles = args.tiles or ([] if args.cuda or args.experts or args.attention
                           else [q4_layout.LINEAR_TILE.name])
    for spec in tiles:
        r = loop_report(Q4Tile.parse(spec))
        print(f"{spec}: kernel {r.total} instructions, K loop {r.loop} = {r.per_weight:.1f} per "
              f"weight per thread")
        print("    " + ", ".join(f"{o} {c}" for o, c in r.ops.most_common(14)))


if __name__ == "__main__":
    main()
