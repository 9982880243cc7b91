"""kernels/cuda_xs.py without a GPU: the module compiles for sm_90 without spills, its split
CTAs a thread block cluster that merges through distributed shared memory, the A fragments by
ldmatrix from the staged rows; the host side declines what it cannot take. Its values are
checked on a GPU (tests/kernels/test_gpu.py)."""

from __future__ import annotations

import re

import pytest
import torch

from kernels import cuda_xs  # (no Triton here: test_triton_kernels.py interprets it)
from tests.kernels import ptxas


@pytest.mark.skipif(not ptxas.HAVE_NVRTC, reason="needs NVRTC and the CUDA headers")
def test_the_xs_module_compiles_for_hopper_as_split_clusters_without_spills(tmp_path):
    code = cuda_xs.ptx("compute_90")
    assert set(re.findall(rb"\.entry (\w+)\(", code)) == set(cuda_xs.ENTRIES)
    bodies = {b.split("(")[0]: b for b in code.decode().split(".visible .entry ")[1:]}
    for s in cuda_xs.SPLITS:
        for mt in cuda_xs.M_TILES:
            body = bodies[f"q4_xs{mt}_2_s{s}_d2"]
            assert "griddepcontrol.wait;" in body
            # a block's two k16 chunks for each m16 tile: two ldmatrix.x4, 2 x 2 MMAs
            assert body.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") >= 2 * mt
            assert body.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") >= 4 * mt
            if s > 1:  # the splits one cluster: merged from the ranks' shared memory, then
                # a second barrier phase so no CTA leaves while another reads its partials
                assert re.search(rf"\.reqnctapercluster\s+1,\s*{s},\s*1", body)
                assert body.count("barrier.cluster.arrive") == 2
                assert "mapa.shared::cluster" in body and "ld.shared::cluster.v4.f32" in body
            else:
                assert "barrier.cluster" not in body
    built = ptxas.report(code, tmp_path)
    assert set(built) == {n.decode() for n in cuda_xs.ENTRIES}
    assert not any(spill for _, spill in built.values())
    # 64 rows at depth 2: two 256-thread CTAs an SM (qkv's 160 CTAs in one wave)
    assert all(built[f"q4_xs4_2_s{s}_d2"][0] <= 128 for s in cuda_xs.SPLITS)


def test_the_xs_linear_declines_what_it_cannot_take():
    """CPU tensors, row counts outside 9-64 and other formats: the Triton tile runs."""
    out = torch.zeros(16, 128)
    assert not cuda_xs.fits(object(), torch.zeros(16, 2048), out)
    from kernels import q4_layout
    from kernels.linear import Linear
    scale = torch.full((128, 2048 // 32), 0.01)
    lin = q4_layout.repack(Linear.q4(torch.zeros(128, 1024, dtype=torch.uint8), scale, -8 * scale))
    for rows in (8, 16, 65):
        assert not cuda_xs.fits(lin, torch.zeros(rows, 2048), torch.zeros(rows, 128))
