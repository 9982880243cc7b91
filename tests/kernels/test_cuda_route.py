"""kernels/cuda_route.py without a GPU: the module compiles for sm_90 without spills, as a
cluster of 8 CTAs that wait on their predecessor (PDL) and meet at cluster barriers; the host
side declines CPU tensors. Its values are checked on a GPU (tests/kernels/test_gpu.py)."""

from __future__ import annotations

import re

import pytest
import torch

from kernels import cuda_route  # (no Triton here: test_triton_kernels.py interprets it)
from tests.kernels import ptxas



@pytest.mark.skipif(not ptxas.HAVE_NVRTC, reason="needs NVRTC and the CUDA headers")
def test_the_route_module_compiles_for_hopper_as_a_cluster_without_spills(tmp_path):
    code = cuda_route.ptx("compute_90")
    assert set(re.findall(rb"\.entry (\w+)\(", code)) == set(cuda_route.ENTRIES)
    bodies = {b.split("(")[0]: b for b in code.decode().split(".visible .entry ")[1:]}
    for name, body in bodies.items():
        assert "griddepcontrol.wait;" in body, name
    for name in ("q4_route8_2_d2", "q4_route8_2_d2_k4", "q4_route8_2_d2_k16"):
        route = bodies[name]
        assert re.search(r"\.reqnctapercluster\s+8,\s*1,\s*1", route), name
        # two cluster barrier phases, the logits stored into CTA 0's shared memory between them
        assert route.count("barrier.cluster.arrive") == 2 and route.count("barrier.cluster.wait") == 2
        assert "mapa.shared::cluster" in route and "st.shared::cluster.f32" in route
        assert route.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") >= 4
    # the folded norm: the row's sum of squares in the CUDA norm's butterfly, an IEEE square
    # root and division, before the ring reads x
    folded = bodies["q4_route8_2_d2_k16"]
    assert folded.count("shfl.sync.bfly.b32") >= 5 and "sqrt.rn.f32" in folded
    built = ptxas.report(code, tmp_path)
    assert set(built) == {n.decode() for n in cuda_route.ENTRIES}
    assert not any(spill for _, spill in built.values())
    for name in ("q4_route8_2_d2", "q4_route8_2_d2_k16"):
        assert built[name][0] <= 128, name  # 512 threads a CTA, one CTA an SM


def test_the_route_declines_what_it_cannot_take():
    """CPU tensors and what is not a GPU-format q4 router: the Triton route runs."""
    x = torch.zeros(1, 2048)
    assert not cuda_route.route_fits(x, object(), 8)
    assert not cuda_route.norm_route_fits(x, torch.ones(2048), object(), 8)
    assert not cuda_route.topk_fits(torch.zeros(3, 128), 8)
