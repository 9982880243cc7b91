"""kernels/cuda_norm.py without a GPU: its module compiles for sm_90 without spills, loads the
norm weight before the PDL wait and x after it; CPU tensors go to the other kernels. Its values
are checked on a GPU (tests/kernels/test_gpu.py)."""

from __future__ import annotations

import re

import pytest
import torch

from kernels import cuda_norm  # (no Triton here: test_triton_kernels.py interprets it)
from tests.kernels import ptxas



@pytest.mark.skipif(not ptxas.HAVE_NVRTC, reason="needs NVRTC and the CUDA headers")
def test_the_norm_module_compiles_for_hopper_without_spills_weights_before_the_wait(tmp_path):
    code = cuda_norm.ptx("compute_90")
    assert set(re.findall(rb"\.entry (\w+)\(", code)) == set(cuda_norm.ENTRIES)
    for name, body in {b.split("(")[0]: b for b in code.decode().split(".visible .entry ")[1:]}.items():
        wait = body.index("griddepcontrol.wait;")
        assert body.count("shfl.sync.bfly") == 5, name  # one butterfly: the row's sum
        assert re.search(r"ld\.global(\.nc)?\.v4\.f32", body[wait:]), name  # x: after
        if name.startswith("rms_rows"):
            assert body.index("ld.global.nc.v4.f32") < wait, name  # the norm weight: before
        else:  # the folded form: the ring's first GEMM weights before, x_n staged in shared
            assert body.index("ld.global.nc") < wait, name  # memory and read back after
            assert "st.shared" in body[wait:] and "ld.shared" in body[wait:], name
            assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in body, name
    built = ptxas.report(code, tmp_path)
    assert set(built) == {n.decode() for n in cuda_norm.ENTRIES}
    assert not any(spill for _, spill in built.values())


def test_the_cuda_norm_declines_cpu_tensors_and_other_widths():
    w = torch.ones(2048)
    assert not cuda_norm.fits(torch.zeros(3, 2048), w)
    assert not cuda_norm.fits(torch.zeros(3, 576), torch.ones(576))
