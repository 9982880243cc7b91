"""kernels/cuda_norm.py without a GPU: its module compiles for sm_90 without spills, loads the
norm weight before the PDL wait and x after it; CPU tensors go to the other kernels. Its values
are checked on a GPU (tests/kernels/test_gpu.py)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from kernels import cuda_norm, cuda_q4  # (no Triton here: test_triton_kernels.py interprets it)

HAVE_NVRTC = cuda_q4._find("libnvrtc.so*[0-9]") is not None and cuda_q4._find("cuda_fp16.h") is not None


@pytest.mark.skipif(not HAVE_NVRTC, reason="needs NVRTC and the CUDA headers")
def test_the_norm_module_compiles_for_hopper_without_spills_weights_before_the_wait(tmp_path):
    code = cuda_norm.ptx("compute_90")
    assert set(re.findall(rb"\.entry (\w+)\(", code)) == set(cuda_norm.ENTRIES)
    for name, body in {b.split("(")[0]: b for b in code.decode().split(".visible .entry ")[1:]}.items():
        wait = body.index("griddepcontrol.wait;")
        assert body.index("ld.global.nc.v4.f32") < wait, name  # the weight: before
        assert "ld.global.v4.f32" in body[wait:] or "ld.global.f32" in body[wait:], name  # x: after
        assert body.count("shfl.sync.bfly") == 5, name  # one butterfly: the row's sum
    triton = pytest.importorskip("triton")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    src = tmp_path / "norm.ptx"
    src.write_bytes(code)
    out = subprocess.run([ptxas, "-arch=sm_90", "-v", str(src), "-o", str(tmp_path / "n.cubin")],
                         capture_output=True, text=True)
    if "Unsupported .version" in out.stderr:  # NVRTC newer than Triton's ptxas
        pytest.skip(f"{ptxas} is older than NVRTC: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out.stderr)]
    assert len(spills) == len(cuda_norm.ENTRIES) and not any(spills)


def test_the_cuda_norm_declines_cpu_tensors_and_other_widths():
    w = torch.ones(2048)
    assert not cuda_norm.fits(torch.zeros(3, 2048), w)
    assert not cuda_norm.fits(torch.zeros(3, 576), torch.ones(576))
