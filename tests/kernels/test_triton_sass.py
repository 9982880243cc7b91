"""bench.sass_report compiles the q4 GEMM for sm_90 without a GPU and finds its K loop.
Run as a subprocess: the interpreter tests in this directory import Triton in interpreter mode."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _compiled(args: list[str]) -> str:
    """stdout of `python args` in a process of its own that compiles for sm_90 (not in the
    interpreter this directory's other tests run in)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_sass_report_counts_the_k_loop_of_the_engine_tile():
    """The engine's q4 tile compiles for sm_90 with the raw bytes loaded straight into the MMA
    operand layout: no shared-memory stores in the K loop, and a few instructions per weight
    (the v5 loop took 9.7; this one about 3)."""
    out = _compiled(["-m", "bench.sass_report", "16x64x64w1s3"])
    loops = re.findall(r"K loop (\d+) = ([\d.]+) per weight", out)
    assert len(loops) == 1, out
    n, per_weight = int(loops[0][0]), float(loops[0][1])
    assert 100 < n < 5000 and 1.0 < per_weight < 5.0, out
    assert "HMMA" in out and "LDGSTS" in out
    assert re.search(r"(?<![A-Z.])STS \d", out) is None, out


def test_paged_attention_streams_its_key_tiles_through_the_pipeline():
    """The split kernel's key tiles go through Triton's software pipeline (cp.async into shared
    memory); the hand-prefetched form (tiles in registers) ran at 0.7-0.8x the bandwidth on the
    H200 (GPU_NOTES v9). 128-key tiles on 4 warps take 192 registers a thread (64-key tiles on
    8: ~80; v20), within the 255 a thread may hold."""
    out = _compiled(["-m", "bench.sass_report", "--attention"])
    m = re.search(r"paged attention \(bf16 KV\): kernel (\d+) instructions, (\d+) LDGSTS, "
                  r"(\d+) registers", out)
    assert m, out
    instr, ldgsts, regs = (int(v) for v in m.groups())
    assert 200 < instr < 5000 and ldgsts > 0 and regs <= 224, out


def test_the_direct_down_kernel_prefetches_its_weights_before_the_wait():
    """Up to DIRECT_MAX_TOKENS tokens the down kernel prefetches its weights into L2 before
    waiting on gate_up (CCTL.E.PF2 in the SASS); gate_up and the grouped seq kernels
    do not."""
    code = ("from bench import sass_report as sr\n"
            "from kernels import moe_layout\n"
            "for kind in ('gate_up', 'down'):\n"
            "    for direct in (False, True):\n"
            "        k = sr.compile_expert(kind, moe_layout.Q4_EXPERT_TILE, None, direct=direct)\n"
            "        print(kind, direct, sr.sass(k.asm['cubin']).count('CCTL.E.PF2'))\n")
    out = _compiled(["-c", code])
    counts = {tuple(line.split()[:2]): int(line.split()[2]) for line in out.splitlines()}
    assert counts[("gate_up", "False")] == counts[("gate_up", "True")] == 0, out
    assert counts[("down", "False")] == 0 and counts[("down", "True")] > 0, out


def test_early_inputs_are_loaded_before_the_pdl_wait():
    """triton_pdl.EARLY_INPUTS, compiled for sm_90: the RMSNorm's weight and the RoPE kernel's
    position, tables, norm weight and slot load before griddepcontrol.wait, the activations
    after; without it every load follows the wait."""
    code = ("from bench.sass_report import _compile\n"
            "from kernels import triton_norm as n\n"
            "for early in (False, True):\n"
            "    a = _compile(n._rms_norm_kernel, dict(BLOCK=2048, PDL=True, EARLY=early), {}, "
            "{'eps': 'fp32'}, set(), 90, num_warps=4, launch_pdl=True).asm['ptx']\n"
            "    b = _compile(n._qkv_rope_store_kernel, dict(H=32, KVH=4, D=128, HG=8, KVH_PAD=4, "
            "HAS_NORM=True, PDL=True, EARLY=early), {'pos_ptr': '*i64', 'slot_ptr': '*i64', "
            "'kc_ptr': '*bf16', 'vc_ptr': '*bf16'}, {'eps': 'fp32'}, set(), 90, num_warps=1, "
            "launch_pdl=True).asm['ptx']\n"
            "    for name, ptx in (('norm', a), ('rope', b)):\n"
            "        w = ptx.index('griddepcontrol.wait')\n"
            "        print(name, early, ptx[:w].count('ld.global'), ptx[w:].count('ld.global'))\n")
    out = _compiled(["-c", code])
    counts = {tuple(line.split()[:2]): tuple(map(int, line.split()[2:])) for line in out.splitlines()}
    for name in ("norm", "rope"):
        assert counts[(name, "False")][0] == 0, out  # nothing before the wait
        before, after = counts[(name, "True")]
        assert before > 0 and after > 0, out  # older inputs before, activations after
    assert counts[("rope", "True")][0] >= 6, out  # position, 4 table halves, weight, slot


def test_the_swapped_register_cta_forms_run_half_the_mmas_in_a_shorter_loop():
    """cuda_q4.SWAP_REGS's entries against the CTA forms they replace (bench.sass_report
    --cuda, NVRTC's PTX through Triton's ptxas): the one-row gate_up and qkv's 1-8 rows at 16
    columns a warp run half the HMMAs a ring round, in fewer instructions (GPU_NOTES v28:
    266 → 220 and 526 → 439)."""
    from tests.kernels.ptxas import HAVE_NVRTC
    if not HAVE_NVRTC:
        pytest.skip("needs NVRTC and the CUDA headers")
    out = _compiled(["-m", "bench.sass_report", "--cuda",
                     "q4_egu2_d4,q4_esgu2_d4,q4_cta8_2_d8,q4_ctas8_2_d8"])
    loops = {m[0]: (int(m[1]), int(m[2])) for m in
             re.findall(r"(q4_\w+): kernel \d+ instructions, \d+ registers; MMA loop (\d+) "
                        r"\(HMMA (\d+)", out)}
    assert len(loops) == 4, out
    for plain, swapped in (("q4_egu2_d4", "q4_esgu2_d4"), ("q4_cta8_2_d8", "q4_ctas8_2_d8")):
        assert loops[swapped][1] * 2 == loops[plain][1] > 0, out
        assert loops[swapped][0] < 0.9 * loops[plain][0], out
