"""kernels/cuda_xs.py without a GPU: the modules (the linear's, the experts') compile for sm_90
without spills, their split CTAs a thread block cluster that merges through distributed shared
memory, the A fragments by ldmatrix from the staged rows; the host side declines what it cannot
take; their source run on the CPU (tests/kernels/cuda_emu.py) writes every output, each
within fp16 rounding of float64. Their bits are judged on a GPU (tests/kernels/test_gpu.py)."""

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


@pytest.mark.skipif(not ptxas.HAVE_NVRTC, reason="needs NVRTC and the CUDA headers")
def test_the_experts_module_compiles_as_split_clusters_without_spills(tmp_path):
    """gate_up (SiLU · up into fp16) and down (fp32 sums) for 16 / 32 rows a pass, the gate_up
    waiting before it reads the slots, down reading them (and its first weights) before."""
    code = cuda_xs.ptx("compute_90", experts=True)
    assert set(re.findall(rb"\.entry (\w+)\(", code)) == set(cuda_xs.EXPERT_ENTRIES)
    bodies = {b.split("(")[0]: b for b in code.decode().split(".visible .entry ")[1:]}
    for s in cuda_xs.SPLITS:
        for mt in cuda_xs.EXPERT_M_TILES:
            gu, dn = bodies[f"q4_xegu{mt}_s{s}_d4"], bodies[f"q4_xedn{mt}_s{s}_d4"]
            for body in (gu, dn):
                assert body.count("griddepcontrol.wait;") == 1
                assert body.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") >= 2 * mt
                assert body.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") >= 4 * mt
                assert ("barrier.cluster.arrive" in body) == (s > 1)
                if s > 1:
                    assert re.search(rf"\.reqnctapercluster\s+1,\s*{s},\s*1", body)
                    assert "ld.shared::cluster.v4.f32" in body
            # gate_up: SiLU's ex2 and the fp16 stores; down: neither
            assert "ex2.approx.f32" in gu and "cvt.rn.f16.f32" in gu
            assert "ex2.approx.f32" not in dn
            # gate_up reads the slot count only after its wait; down before (global loads first)
            assert gu.index("griddepcontrol.wait;") < gu.index("ld.global")
            assert dn.index("ld.global") < dn.index("griddepcontrol.wait;")
    built = ptxas.report(code, tmp_path)
    assert set(built) == {n.decode() for n in cuda_xs.EXPERT_ENTRIES}
    assert not any(spill for _, spill in built.values())
    # 16 rows a pass: two 256-thread CTAs an SM at every depth
    assert all(built[f"q4_xe{k}1_s{s}_d{d}"][0] <= 128 for k in ("gu", "dn")
               for s in cuda_xs.SPLITS for d in cuda_xs.EXPERT_DEPTHS)


def test_the_experts_plan_and_decline():
    """The ring depth divides a split's blocks; shared memory holds the staged rows (or the
    partial tile) and the pass's assignment ids; CPU tensors and other token counts decline."""
    # Qwen3-30B-A3B: gate_up [1536, 2048] in 2 splits (32 blocks each), down [2048, 768] (12);
    # shared memory: 16 rows of (split + 8) halves, the 16 x 128 partial tile, 16 ids
    assert cuda_xs._expert_plan(1536, 2048, 2, 16, 8) == (1, 8, 16 * (1032 * 2 + 128 * 4 + 4), 1)
    assert cuda_xs._expert_plan(2048, 768, 2, 16, 8) == (1, 4, 16 * (392 * 2 + 128 * 4 + 4), 1)
    assert cuda_xs._expert_plan(2048, 768, 2, 32, 8)[:2] == (2, 4)
    assert cuda_xs._expert_plan(2048, 768, 1, 16, 8)[1] == 8  # 24 blocks
    assert cuda_xs._expert_plan(2048, 768, 4, 16, 8)[1] == 2  # 6 blocks
    # column tiles a CTA: the most dividing N's 128-column tiles (gate_up 12, down 16)
    tiles = [cuda_xs._expert_plan(1536, 2048, 2, 16, 8, t)[3] for t in (1, 2, 4, 5, 12)]
    assert tiles == [1, 2, 4, 4, 12]
    assert [cuda_xs._expert_plan(2048, 768, 2, 16, 8, t)[3] for t in (3, 6, 8)] == [2, 4, 8]
    from kernels import moe_layout
    from kernels.linear import Linear

    def q4(n, k):
        scale = torch.full((n, k // 32), 0.01)
        return Linear.q4(torch.zeros(n, k // 2, dtype=torch.uint8), scale, -8 * scale)

    stacked = moe_layout.StackedExperts.stack(tuple((q4(256, 128), q4(128, 128)) for _ in range(4)))
    assert stacked.fmt == "q4"
    for t in (8, 16, 65):
        assert not cuda_xs.experts_fit(stacked, torch.zeros(t, 128), t)
    with pytest.raises(ValueError):
        cuda_xs.experts_grouped(torch.zeros(16, 128), torch.zeros(3, dtype=torch.int32),
                                torch.zeros(1, 16, dtype=torch.int32), 2, stacked,
                                torch.zeros(32, 128, dtype=torch.float16), torch.zeros(32, 128),
                                rows=48)


# ---- the kernels run on the CPU (tests/kernels/cuda_emu.py): what they write, and where ----
@pytest.fixture(scope="module")
def emu():
    from tests.kernels import cuda_emu
    if not cuda_emu.available():
        pytest.skip("needs a C++20 compiler (g++)")
    from kernels import cuda_q4, cuda_route
    return cuda_emu.build(cuda_q4.SOURCE + cuda_route.CLUSTER_DEVICE + cuda_xs.XS
                          + cuda_xs.XS_ENTRIES + cuda_xs.XE)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} outputs left unwritten"
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("n,k,programs", [(256, 512, None), (384, 256, 4), (256, 1024, 8), (128, 512, 8)])
def test_the_x_staged_linear_on_the_emulator_matches_float64(emu, monkeypatch, n, k, programs):
    """q4_xs's source run on the CPU: every row and column written, x @ W.T + residual within
    fp16 rounding of x (the emulator's MMA sums in float64: not the GPU's bits) at 9-64 rows,
    1-8 splits, 2-8 warps and rings of 2 and 4 — what the GPU test then judges bit for bit."""
    from kernels import q4_layout, triton_linear
    from kernels.linear import quantize_q4
    from tests.kernels import cuda_emu
    if programs:
        monkeypatch.setattr(q4_layout, "MAX_PROGRAMS", programs)
    g = torch.Generator().manual_seed(n + k)
    base = quantize_q4(torch.randn(n, k, generator=g))
    lin = triton_linear.to_gpu_format(base)
    assert lin.split == {None: 8, 4: 1}.get(programs, 2 if n == 256 else 4)  # each split count
    x = torch.randn(64, k, generator=g)
    res = torch.randn(64, n, generator=g)
    ref = base.reference(x)
    cases = [(9, None, None, True), (40, None, None, False), (64, None, None, True),
             (17, 2, 2, True), (33, 4, 4, False)]
    with cuda_emu.emulated(emu, monkeypatch):
        for rows, warps, depth, with_res in cases:
            if depth and (k // lin.split // 32) % depth:  # the ring must divide a split
                depth = 2
            out = cuda_xs.linear(lin, x[:rows], torch.full((rows, n), float("nan")),
                                 residual=res[:rows] if with_res else None, warps=warps, depth=depth)
            want = ref[:rows] + (res[:rows].double() if with_res else 0)
            assert _rel(out, want) < 1e-3, (rows, warps, depth, lin.split)


def _align(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """triton_moe_route.align's meta / arows on the CPU (its layout; the kernel is Triton's)."""
    t, k = ids.shape
    slots = min(experts, t * k)
    meta = torch.zeros(1 + 2 * slots, dtype=torch.int32)
    arows = torch.full((slots, t), -7, dtype=torch.int32)  # past a slot's count: never read
    used = sorted(set(ids.flatten().tolist()))
    meta[0] = len(used)
    for r, e in enumerate(used):
        a = (ids.flatten() == e).nonzero().flatten()
        meta[1 + 2 * r], meta[2 + 2 * r] = e, len(a)
        arows[r, :len(a)] = a.int()
    return meta, arows


@pytest.mark.parametrize("programs", [None, 8])
def test_the_x_staged_experts_on_the_emulator_match_float64(emu, monkeypatch, programs):
    """q4_xs_experts' source run on the CPU: each assignment's silu(gate) * up and its down
    row within fp16 rounding of float64 (not the GPU's bits), every one written, at 9-40
    tokens, 16 / 32 rows a pass, rings of 2-8, 1-2 column tiles a CTA, gate_up in 2 or 4 K
    splits; a slot of 40 rows runs 3 passes."""
    from kernels import moe_layout
    from kernels.linear import quantize_q4
    from tests.kernels import cuda_emu
    g = torch.Generator().manual_seed(3)
    e, h, i, k = 6, 256, 128, 2
    experts = tuple((quantize_q4(torch.randn(2 * i, h, generator=g)),
                     quantize_q4(torch.randn(h, i, generator=g))) for _ in range(e))
    st = moe_layout.StackedExperts.stack(experts, programs=programs)
    assert st.gu_split in (2, 4) and st.down_split in cuda_xs.SPLITS
    gu = [p[0].dequantize().double() for p in experts]
    dn = [p[1].dequantize().double() for p in experts]
    skew = torch.tensor([[0, 3]] * 40, dtype=torch.int32)  # two slots of 40 rows
    cases = [(9, 16, 8, 1, None), (20, 32, 4, 2, None), (40, 16, 2, 2, skew)]
    with cuda_emu.emulated(emu, monkeypatch):
        for t, rows, depth, tiles, ids in cases:
            if ids is None:
                ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
            x = torch.randn(t, h, generator=g)
            meta, arows = _align(ids, e)
            inter = torch.full((t * k, i), float("nan")).half()
            y = torch.full((t * k, h), float("nan"))
            cuda_xs.experts_grouped(x, meta, arows, k, st, inter, y, rows, depth, tiles)
            want_i = torch.empty(t * k, i, dtype=torch.float64)
            want_y = torch.empty(t * k, h, dtype=torch.float64)
            for a in range(t * k):
                ex = int(ids[a // k, a % k])
                gate_up = gu[ex] @ x[a // k].half().double()  # x as the kernel stages it
                want_i[a] = gate_up[:i] * torch.sigmoid(gate_up[:i]) * gate_up[i:]
                want_y[a] = dn[ex] @ inter[a].double()  # from the kernel's own fp16 rows
            assert _rel(inter, want_i) < 2e-3, (programs, t, rows, depth, tiles)
            assert _rel(y, want_y) < 1e-3, (programs, t, rows, depth, tiles)
