"""Shared by the CUDA kernel modules' compile tests: NVRTC's availability and ptxas's report
(registers and spill stores per entry) for sm_90, through the ptxas Triton ships."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from kernels import cuda_q4

HAVE_NVRTC = cuda_q4._find("libnvrtc.so*[0-9]") is not None and cuda_q4._find("cuda_fp16.h") is not None


def report(code: bytes, tmp_path) -> dict[str, tuple[int, int]]:
    """{entry: (registers, spill store bytes)} of PTX `code` assembled for sm_90 (skips where
    Triton's ptxas is older than NVRTC; a failed assembly fails the test)."""
    triton = pytest.importorskip("triton")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    src = tmp_path / "module.ptx"
    src.write_bytes(code)
    out = subprocess.run([ptxas, "-arch=sm_90", "-v", str(src), "-o", str(tmp_path / "module.cubin")],
                         capture_output=True, text=True)
    if "Unsupported .version" in out.stderr:  # NVRTC newer than Triton's ptxas
        pytest.skip(f"{ptxas} is older than NVRTC: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr
    names = re.findall(r"Compiling entry function '(\w+)'", out.stderr)
    regs = [int(n) for n in re.findall(r"Used (\d+) registers", out.stderr)]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out.stderr)]
    assert len(names) == len(regs) == len(spills), out.stderr[-2000:]
    return dict(zip(names, zip(regs, spills)))
