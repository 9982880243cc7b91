"""kernels.sass_report compiles the q4 GEMM for sm_90 without a GPU and finds its K loop.
Run as a subprocess: the interpreter tests in this directory import Triton in interpreter mode."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_sass_report_counts_the_k_loop_of_the_engine_tile_and_a_variant():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "kernels.sass_report", "16x32x128w4s2",
                          "16x32x128w4s2:elem"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    loops = re.findall(r"K loop (\d+) = ([\d.]+) per weight", out.stdout)
    assert len(loops) == 2, out.stdout
    (base, base_w), (elem, elem_w) = [(int(a), float(b)) for a, b in loops]
    # the loop holds the tile's MMAs and its dequant: tens to hundreds of instructions
    assert 50 < base < elem < 5000 and 1.0 < base_w < elem_w, out.stdout
    assert "HMMA" in out.stdout and "LDG" in out.stdout
