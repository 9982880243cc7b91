"""cuda_q4's kernels run on the CPU (tests/kernels/cuda_emu.py): every output written, each
within fp16 rounding of float64, and the forms the GPU tests prove bit-equal give equal bits on
the emulator too (the same fragments into the same MMAs in the same order; the emulator's MMA
is not the GPU's, but a form that fed it otherwise would differ). What a new kernel's source
must pass before a device call judges its bits (tests/kernels/test_gpu.py, test_cuda_q4.py).
The emulator's thread block clusters are checked on a small kernel written here."""

from __future__ import annotations

import pytest
import torch

from kernels import cuda_q4  # (no Triton here: test_triton_kernels.py interprets it)
from tests.kernels import cuda_emu, ptxas


@pytest.fixture(scope="module")
def emu():
    if not cuda_emu.available():
        pytest.skip("needs a C++20 compiler (g++)")
    return cuda_emu.build(cuda_q4.SOURCE + cuda_q4.CORE + cuda_q4.EXTRA)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} outputs left unwritten"
    return float((out.double() - ref).norm() / ref.norm())


def test_the_emulator_rewrites_each_ptx_instruction_and_refuses_others():
    code = cuda_emu.translate('__device__ void f(unsigned a, unsigned& b) {\n'
                              '  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(b) : "r"(a), "r"(a), "r"(a));\n'
                              '  asm volatile("griddepcontrol.wait;" ::: "memory");\n'
                              '  asm volatile("trap;");\n}')
    assert "b = emu::prmt(a, a, a);" in code and "asm" not in code
    assert 'throw std::runtime_error("trap");' in code
    with pytest.raises(ValueError, match="no emulation"):
        cuda_emu.translate('asm volatile("bar.sync 0;");')


@pytest.mark.parametrize("n,k,programs", [(256, 512, None), (384, 256, 4), (256, 1024, 8), (128, 512, 8)])
def test_the_cta_form_and_the_split_programs_on_the_emulator(emu, monkeypatch, n, k, programs):
    """q4_cta (a CTA a column tile's splits, merged in shared memory) and q4_split (a program
    a split, merged by the last one's ticket) at 1-20 rows, 1-8 splits, with and without the
    residual: within fp16 rounding of x @ W.T in float64, every output written, the same bits
    as each other (the GPU tests: both the decode tile's)."""
    from kernels import q4_layout, triton_linear
    from kernels.linear import quantize_q4
    if programs:
        monkeypatch.setattr(q4_layout, "MAX_PROGRAMS", programs)
    g = torch.Generator().manual_seed(n + k)
    base = quantize_q4(torch.randn(n, k, generator=g))
    lin = triton_linear.to_gpu_format(base)
    assert lin.split == {None: 8, 4: 1}.get(programs, 2 if n == 256 else 4)  # each split count
    x = torch.randn(20, k, generator=g)
    res = torch.randn(20, n, generator=g)
    ref = base.reference(x)
    with cuda_emu.emulated(emu):
        for rows, with_res in ((1, True), (8, False), (20, True)):
            r = res[:rows] if with_res else None
            cta = cuda_q4.linear(lin, x[:rows], torch.full((rows, n), float("nan")), r, cta=True)
            split = cuda_q4.linear(lin, x[:rows], torch.full((rows, n), float("nan")), r, cta=False)
            want = ref[:rows] + (res[:rows].double() if with_res else 0)
            assert _rel(cta, want) < 1e-3, (rows, lin.split)
            assert torch.equal(cta, split), (rows, lin.split)


def test_the_direct_experts_on_the_emulator(emu):
    """q4_expert_cta (a CTA an assignment's column tile, its K splits merged in shared memory)
    at 1-3 tokens of top-2 over 6 experts, gate_up in 2 and 4 splits: silu(gate) * up and the
    down rows within fp16 rounding of float64, every one written; cuda_q4's own launcher is
    back after the block."""
    real = cuda_q4._launch
    from kernels import moe_layout
    from kernels.linear import quantize_q4
    g = torch.Generator().manual_seed(3)
    e, h, i, k = 6, 256, 128, 2
    experts = tuple((quantize_q4(torch.randn(2 * i, h, generator=g)),
                     quantize_q4(torch.randn(h, i, generator=g))) for _ in range(e))
    gu = [p[0].dequantize().double() for p in experts]
    dn = [p[1].dequantize().double() for p in experts]
    with cuda_emu.emulated(emu):
        for programs, t in ((None, 1), (8, 3)):
            st = moe_layout.StackedExperts.stack(experts, programs=programs)
            x = torch.randn(t, h, generator=g)
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
            inter = torch.full((t * k, i), float("nan")).half()
            y = torch.full((t * k, h), float("nan"))
            cuda_q4.experts_direct(x, ids.contiguous(), st, inter, y)
            want_i = torch.empty(t * k, i, dtype=torch.float64)
            want_y = torch.empty(t * k, h, dtype=torch.float64)
            for a in range(t * k):
                ex = int(ids[a // k, a % k])
                gate_up = gu[ex] @ x[a // k].half().double()  # x as the MMA takes it
                want_i[a] = gate_up[:i] * torch.sigmoid(gate_up[:i]) * gate_up[i:]
                want_y[a] = dn[ex] @ inter[a].double()  # from the kernel's own fp16 rows
            assert _rel(inter, want_i) < 2e-3, (programs, t, st.gu_split)
            assert _rel(y, want_y) < 1e-3, (programs, t, st.down_split)
    assert cuda_q4._launch is real


@pytest.mark.parametrize("cols", [16, 32])
def test_the_swapped_registers_give_the_cta_forms_bits_on_the_emulator(emu, monkeypatch, cols):
    """cuda_q4.SWAP_REGS (block_mma_sw: the weights as the MMA's A, 16 columns an MMA, x as B)
    at 1-8 rows of the linear, 1-16 splits (above 8 the 512-thread form), with and without the
    residual, and in the one-row experts: every output written, the CTA forms' bits. The
    emulator's MMA sums an output's 16 products in k order whichever operand holds them, as the
    GPU measured the swapped form doing (GPU_NOTES v15-v16); a wrong fragment, column or row
    index in the swapped path differs."""
    import dataclasses

    from kernels import moe_layout, triton_linear
    from kernels.linear import quantize_q4
    g = torch.Generator().manual_seed(cols)
    n, k = 128, 1024
    base = triton_linear.to_gpu_format(quantize_q4(torch.randn(n, k, generator=g)))
    x, res = torch.randn(8, k, generator=g), torch.randn(8, n, generator=g)
    names, real = [], cuda_q4._launch
    with cuda_emu.emulated(emu):  # (its launcher, the entries' names recorded; restored after)
        emu_launch = cuda_q4._launch
        cuda_q4._launch = lambda cuda, fn, *a: (names.append(fn), emu_launch(cuda, fn, *a))
        for split in (1, 2, 8, 16) if cols == 16 else (1, 2, 8):
            lin = dataclasses.replace(base, split=split)
            for rows, with_res in ((1, True), (5, False), (8, True)):
                r = res[:rows] if with_res else None
                got = {}
                for sw in (False, True):
                    monkeypatch.setattr(cuda_q4, "SWAP_REGS", sw)
                    got[sw] = cuda_q4.linear(lin, x[:rows], torch.full((rows, n), float("nan")), r,
                                             cols=cols, depth=128 // cols, cta=True)
                assert not got[True].isnan().any(), (split, rows)
                assert torch.equal(got[True], got[False]), (split, rows)
        e, h, i, topk = 4, 256, 128, 2
        experts = tuple((quantize_q4(torch.randn(2 * i, h, generator=g)),
                         quantize_q4(torch.randn(h, i, generator=g))) for _ in range(e))
        st = moe_layout.StackedExperts.stack(experts, programs=8)
        xe = torch.randn(3, h, generator=g)
        ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(3)]).int().contiguous()
        got = {}
        for sw in (False, True):
            monkeypatch.setattr(cuda_q4, "SWAP_REGS", sw)
            inter = torch.full((3 * topk, i), float("nan")).half()
            y = torch.full((3 * topk, h), float("nan"))
            cuda_q4.experts_direct(xe, ids, st, inter, y, cols=cols)
            got[sw] = inter, y
        assert not got[True][1].isnan().any()
        assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])
    assert cuda_q4._launch is real
    want = {"q4_ctas8_2_d8", "q4_ctaws8_2_d2", "q4_esgu2_d4", "q4_esdn2_d2"} if cols == 16 else \
        {"q4_ctas8_4_d4", "q4_esgu4_d4", "q4_esdn4_d2"}
    assert want <= set(names), sorted(set(names))


def test_the_streamed_cta_form_gives_the_ring_cta_forms_bits_on_the_emulator(emu, monkeypatch):
    """cuda_q4.CTA_STREAM (q4_cta{s}8_{NT}_d0: each warp's split copied whole into shared
    memory behind the partials before the wait): at 1-8 rows, 8 / 16 / 32 columns a warp, x
    as A and swapped, 1-4 splits, with and without the residual, the register ring's bits and
    every output written; the knob routes the default launch to it, and a weight whose splits
    are not whole groups of 16 blocks keeps the ring."""
    import dataclasses

    from kernels import triton_linear
    from kernels.linear import quantize_q4
    g = torch.Generator().manual_seed(11)
    n, k = 128, 2048
    base = triton_linear.to_gpu_format(quantize_q4(torch.randn(n, k, generator=g)))
    x, res = torch.randn(8, k, generator=g), torch.randn(8, n, generator=g)
    names, real = [], cuda_q4._launch
    with cuda_emu.emulated(emu):
        emu_launch = cuda_q4._launch
        cuda_q4._launch = lambda cuda, fn, *a: (names.append(fn), emu_launch(cuda, fn, *a))
        for split, cols, sw in ((1, 16, True), (2, 8, False), (4, 32, True), (4, 16, False)):
            monkeypatch.setattr(cuda_q4, "SWAP_REGS", sw)
            lin = dataclasses.replace(base, split=split)
            assert cuda_q4.cta_streams(lin, 8, cols) and not cuda_q4.cta_streams(lin, 9, cols)
            for rows, with_res in ((1, True), (5, False), (8, True)):
                r = res[:rows] if with_res else None
                nan = torch.full((rows, n), float("nan"))
                ring = cuda_q4.linear(lin, x[:rows], nan.clone(), r, cols=cols, depth=4, cta=True)
                got = cuda_q4.linear(lin, x[:rows], nan.clone(), r, cols=cols,
                                     depth=cuda_q4.STREAM, cta=True)
                assert not got.isnan().any(), (split, cols, rows)
                assert torch.equal(got, ring), (split, cols, sw, rows)
        monkeypatch.setattr(cuda_q4, "CTA_STREAM", True)
        monkeypatch.setattr(cuda_q4, "SWAP_REGS", True)
        names.clear()
        cuda_q4.linear(dataclasses.replace(base, split=2), x[:1], torch.empty(1, n), cols=16)
        odd = dataclasses.replace(triton_linear.to_gpu_format(quantize_q4(torch.randn(n, 1536, generator=g))),
                                  split=2)  # 24 blocks a split
        assert not cuda_q4.cta_streams(odd, 1, 16)
        cuda_q4.linear(odd, x[:1, :1536], torch.empty(1, n), cols=16)
    assert cuda_q4._launch is real
    assert names == ["q4_ctas8_2_d0", "q4_ctas8_2_d4"], names


def test_the_streamed_one_token_experts_give_the_rings_bits_on_the_emulator(emu, monkeypatch):
    """cuda_q4.EXPERT_STREAM / DOWN_STREAM (q4_e{s}{gu,dn}{NT}_d0: a kernel's splits copied
    whole into shared memory behind the partials; down's before the wait, in 3 commit groups
    where a split is 12 blocks): the ring's intermediate and down rows bit for bit at 1-2
    tokens of top-2 over 4 experts, 16 / 32 columns a warp, x as A and swapped, every one
    written, each knob streaming its own kernel only."""
    from kernels import moe_layout
    from kernels.linear import quantize_q4
    g = torch.Generator().manual_seed(5)
    e, h, i, topk = 4, 512, 768, 2
    experts = tuple((quantize_q4(torch.randn(2 * i, h, generator=g)),
                     quantize_q4(torch.randn(h, i, generator=g))) for _ in range(e))
    names, real = [], cuda_q4._launch
    with cuda_emu.emulated(emu):
        emu_launch = cuda_q4._launch
        cuda_q4._launch = lambda cuda, fn, *a: (names.append(fn), emu_launch(cuda, fn, *a))
        # blocks a split, gate_up / down (commit groups): 16 (4) / 12 (3); 16 (4) / 8 (2); 8 (2) / 4 (1)
        for programs, t, cols, sw, blocks in ((16, 1, 16, True, (16, 12)), (24, 1, 32, False, (16, 8)),
                                              (48, 2, 16, True, (8, 4))):
            monkeypatch.setattr(cuda_q4, "SWAP_REGS", sw)
            st = moe_layout.StackedExperts.stack(experts, programs=programs)
            assert (h // 32 // st.gu_split, i // 32 // st.down_split) == blocks, (st.gu_split, st.down_split)
            x = torch.randn(t, h, generator=g)
            ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)]).int().contiguous()
            got = {}
            for knobs in ((False, False), (True, False), (False, True), (True, True)):
                monkeypatch.setattr(cuda_q4, "EXPERT_STREAM", knobs[0])
                monkeypatch.setattr(cuda_q4, "DOWN_STREAM", knobs[1])
                names.clear()
                inter = torch.full((t * topk, i), float("nan")).half()
                y = torch.full((t * topk, h), float("nan"))
                cuda_q4.experts_direct(x, ids, st, inter, y, cols=cols)
                assert [n.endswith("_d0") for n in names] == list(knobs), (knobs, names)
                got[knobs] = inter, y
                assert not inter.isnan().any() and not y.isnan().any(), knobs
            for knobs, (inter, y) in got.items():
                assert torch.equal(inter, got[False, False][0]), (programs, t, cols, sw, knobs)
                assert torch.equal(y, got[False, False][1]), (programs, t, cols, sw, knobs)
        names.clear()  # depth STREAM streams both whatever the knobs
        monkeypatch.setattr(cuda_q4, "EXPERT_STREAM", False)
        monkeypatch.setattr(cuda_q4, "DOWN_STREAM", False)
        cuda_q4.experts_direct(x[:1], ids[:1], st, torch.empty(topk, i).half(), torch.empty(topk, h),
                               depth=cuda_q4.STREAM)
        stacked = moe_layout.StackedExperts.stack(experts, programs=32)  # down: 4 splits of 6 blocks
        assert i // 32 // stacked.down_split == 6  # (not whole groups of 4: its ring)
        cuda_q4.experts_direct(x[:1], ids[:1], stacked, torch.empty(topk, i).half(), torch.empty(topk, h),
                               depth=cuda_q4.STREAM)
    assert cuda_q4._launch is real
    assert names == ["q4_esgu2_d0", "q4_esdn2_d0", "q4_esgu2_d0", "q4_esdn2_d2"], names


def test_the_fused_one_token_experts_give_the_two_launches_bits_on_the_emulator(emu, monkeypatch):
    """cuda_q4.FUSED_EXPERTS (q4_efused{CS}_2: an assignment's gate_up and down in one cluster
    launch, every split streamed whole into shared memory, the intermediate gathered from the
    cluster's CTAs): experts_direct's intermediate and rows bit for bit at 1-2 tokens of top-2
    over 4 experts, gate_up in 1 or 2 splits, every value written; the knob routes one token
    (not two) to it."""
    import dataclasses

    from kernels import moe_layout
    from kernels.linear import quantize_q4
    g = torch.Generator().manual_seed(9)
    e, h, i, topk = 4, 256, 128, 2
    experts = tuple((quantize_q4(torch.randn(2 * i, h, generator=g)),
                     quantize_q4(torch.randn(h, i, generator=g))) for _ in range(e))
    st = moe_layout.StackedExperts.stack(experts, programs=4)
    names, real = [], cuda_q4._launch
    with cuda_emu.emulated(emu, clusters={"q4_efused4_2": (4, 1, 1)}):
        emu_launch = cuda_q4._launch
        cuda_q4._launch = lambda cuda, fn, *a: (names.append(fn), emu_launch(cuda, fn, *a))
        for stacked in (st, dataclasses.replace(st, gu_split=2)):
            assert cuda_q4._fused_shape(stacked, 4) is not None, (stacked.gu_split, stacked.down_split)
            for t in (1, 2):
                x = torch.randn(t, h, generator=g)
                ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)]).int().contiguous()
                got, want = [], []
                for out, run in ((want, lambda *a: cuda_q4.experts_direct(*a, cols=16, depth=4)),
                                 (got, lambda *a: cuda_q4.experts_fused(*a, cluster=4))):
                    inter = torch.full((t * topk, i), float("nan")).half()
                    y = torch.full((t * topk, h), float("nan"))
                    run(x, ids, stacked, inter, y)
                    out += [inter, y]
                assert not got[0].isnan().any() and not got[1].isnan().any(), (stacked.gu_split, t)
                assert torch.equal(got[0], want[0]), (stacked.gu_split, t, "inter")
                assert torch.equal(got[1], want[1]), (stacked.gu_split, t, "y")
        monkeypatch.setattr(cuda_q4, "FUSED_EXPERTS", True)
        monkeypatch.setattr(cuda_q4, "FUSED_CLUSTER", 4)
        names.clear()
        for t in (1, 2):
            cuda_q4.experts_direct(x[:t], ids[:t], st, torch.empty(t * topk, i).half(),
                                   torch.empty(t * topk, h))
    assert cuda_q4._launch is real
    assert names == ["q4_efused4_2", "q4_esgu2_d4", "q4_esdn2_d4"], names


def test_the_fused_experts_with_the_top_k_folded_in_give_topk_then_the_experts_bits_on_the_emulator(
        emu):
    """cuda_q4.FUSED_TOPK: the CUDA top-k (topk_rows) picks softmax's top-k, ties to the lower
    id, weights renormalized; the fused experts ranking the logits themselves (q4_efusedk)
    give its ids and weights and the two launches' inter and y bit for bit, at 1-2 tokens."""
    from kernels import moe_layout
    from kernels.linear import quantize_q4
    g = torch.Generator().manual_seed(21)
    e, h, i, topk = 8, 256, 128, 2
    experts = tuple((quantize_q4(torch.randn(2 * i, h, generator=g)),
                     quantize_q4(torch.randn(h, i, generator=g))) for _ in range(e))
    st = moe_layout.StackedExperts.stack(experts, programs=4)
    with cuda_emu.emulated(emu, clusters={"q4_efusedk4_2": (4, 1, 1)}):
        for t, norm in ((1, True), (2, False)):
            logits = torch.randn(t, e, generator=g)
            logits[0, 5] = logits[0, 2] = logits[0].max() + 1  # a tie: the lower id first
            ids, wts = torch.full((t, topk), -1, dtype=torch.int32), torch.full((t, topk), float("nan"))
            cuda_q4.topk(logits, topk, norm, ids, wts)
            p = torch.softmax(logits.double(), -1)
            want_w, want_i = p.topk(topk, -1, sorted=True)
            assert ids[0].tolist() == [2, 5] and torch.equal(ids.long(), want_i), (ids, want_i)
            if norm:
                want_w = want_w / want_w.sum(-1, keepdim=True)
            assert torch.allclose(wts.double(), want_w, rtol=1e-6), (wts, want_w)
            x = torch.randn(t, h, generator=g)
            inter = torch.full((t * topk, i), float("nan")).half()
            y = torch.full((t * topk, h), float("nan"))
            cuda_q4.experts_direct(x, ids, st, inter, y, cols=16, depth=4)
            got_ids, got_w = torch.full_like(ids, -1), torch.full_like(wts, float("nan"))
            got_i, got_y = torch.full_like(inter, float("nan")), torch.full_like(y, float("nan"))
            cuda_q4.experts_fused(x, got_ids, st, got_i, got_y, cluster=4, logits=logits, wts=got_w,
                                  norm=norm)
            assert torch.equal(got_ids, ids) and torch.equal(got_w, wts), (t, got_ids, ids)
            assert torch.equal(got_i, inter) and torch.equal(got_y, y), t


# a thread block cluster's primitives as the emulator rewrites them: the CTA's rank, the
# cluster barrier, mapa, and loads / stores into another CTA's shared memory
CLUSTER_KERNEL = r"""
__device__ __forceinline__ unsigned rank_in_cluster() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// p's shared address in the cluster's CTA `rank`
__device__ __forceinline__ unsigned in_rank(const void* p, unsigned rank) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}

// block 32, clusters of n CTAs: thread t of CTA b writes 100 b + t into its own mine[t] and
// into the next rank's inbox[t]; after the barrier, out[b] = the next rank's mine (read as
// float4s by threads 0-7), then its own inbox (the previous rank's values)
extern "C" __global__ void neighbours(float* out, int n) {
  __shared__ float4 mine[8];
  __shared__ float inbox[32];
  const unsigned t = threadIdx.x, r = rank_in_cluster();
  const float v = 100.f * blockIdx.x + t;
  reinterpret_cast<float*>(mine)[t] = v;
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(in_rank(inbox + t, (r + 1) % n)), "f"(v)
               : "memory");
  cluster_sync();
  float* o = out + blockIdx.x * 64;
  if (t < 8) {
    float4 w;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(w.x), "=f"(w.y), "=f"(w.z), "=f"(w.w)
                 : "r"(in_rank(mine + t, (r + 1) % n)) : "memory");
    o[4 * t] = w.x; o[4 * t + 1] = w.y; o[4 * t + 2] = w.z; o[4 * t + 3] = w.w;
  }
  o[32 + t] = inbox[t];
  cluster_sync();  // (no CTA leaves while another may still read its shared memory)
}
"""


def test_a_thread_block_cluster_on_the_emulator():
    """Two clusters of 4 CTAs: each CTA's rank, a store into and a float4 load from a
    neighbour's shared memory through mapa, ordered by the cluster barrier."""
    if not cuda_emu.available():
        pytest.skip("needs a C++20 compiler (g++)")
    lib = cuda_emu.build(CLUSTER_KERNEL)
    out = torch.full((8, 64), float("nan"))
    cuda_emu.launch(lib, "neighbours", (8, 1, 1), 32, 0, (4, 1, 1), (out,), (4,))
    b = torch.arange(8)
    nxt, prv = b - b % 4 + (b + 1) % 4, b - b % 4 + (b + 3) % 4
    t = torch.arange(32, dtype=torch.float32)
    want = torch.cat([100 * nxt[:, None] + t, 100 * prv[:, None] + t], dim=1)
    assert torch.equal(out, want)


CHAIN_KERNEL = r"""
// a persistent kernel's handshake between CTAs: CTA b waits for CTA b + 1's flag (a release
// add there, an acquire load here), takes its published total and publishes its own; out =
// the suffix sums of x. Run a cluster at a time, CTA 0 would wait forever.
extern "C" __global__ void suffix(const float* x, float* out, float* total, unsigned* flag, int n) {
  __shared__ float carry;
  const unsigned t = threadIdx.x, b = blockIdx.x;
  if (t == 0) {
    float c = 0.f;
    if (b + 1 < gridDim.x) {
      for (;;) {
        unsigned seen;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(flag + b + 1) : "memory");
        if (seen) break;
        __nanosleep(32);
      }
      c = total[b + 1];
    }
    carry = c;
  }
  __syncthreads();
  float s = carry;
  for (int u = n - 1; u >= (int)t; --u) s += x[b * n + u];
  out[b * n + t] = s;
  if (t == 0) {
    total[b] = s;
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(flag + b), "r"(1u) : "memory");
  }
}
"""


def test_a_coresident_grid_whose_ctas_wait_on_each_other():
    """A launch with `coresident` runs every CTA at once, so CTAs that wait on flags other CTAs
    set (a persistent kernel's phases) finish: 16 CTAs in a chain from the last to the first
    give x's suffix sums exactly (and NVRTC, where installed, compiles it for sm_90 as
    written); launched a cluster at a time, the first CTA's wait fails at the deadline instead
    of hanging; a grid too large to hold at once is refused."""
    if not cuda_emu.available():
        pytest.skip("needs a C++20 compiler (g++)")
    if ptxas.HAVE_NVRTC:
        code = cuda_q4._compile("compute_90", CHAIN_KERNEL).decode()
        assert "ld.acquire.gpu.global.u32" in code and "red.release.gpu.global.add.u32" in code
    lib = cuda_emu.build(CHAIN_KERNEL)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-8, 9, (16, 32), generator=g).float()
    out, total = torch.full_like(x, float("nan")), torch.full((16,), float("nan"))
    flag = torch.zeros(16, dtype=torch.int32)
    cuda_emu.launch(lib, "suffix", (16, 1, 1), 32, 0, (1, 1, 1), (x, out, total, flag), (32,),
                    coresident=True)
    want = x.flatten().flip(0).cumsum(0).flip(0).view(16, 32)
    assert torch.equal(out, want) and torch.equal(total, want[:, 0])
    assert flag.tolist() == [1] * 16
    flag.zero_()  # a cluster at a time, CTA 0 waits for a flag no CTA has run to set
    with pytest.raises(RuntimeError, match="outlived the launch's deadline"):
        cuda_emu.launch(lib, "suffix", (16, 1, 1), 32, 0, (1, 1, 1), (x, out, total, flag), (32,),
                        deadline_s=1)
    with pytest.raises(RuntimeError, match="co-resident grid of 6400 threads"):
        cuda_emu.launch(lib, "suffix", (200, 1, 1), 32, 0, (1, 1, 1),
                        (x, out, total, torch.zeros(200, dtype=torch.int32)), (32,), coresident=True)

