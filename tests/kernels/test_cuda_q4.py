"""kernels/cuda_q4.py, the q4 split programs in CUDA C++ (an experiment beside the Triton
decode tile): its source compiles for sm_90 without a GPU (where NVRTC is installed), and on a
GPU it gives the decode tile's bits."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from kernels import cuda_q4
from tests.kernels import ptxas

HAVE_NVRTC = ptxas.HAVE_NVRTC


@pytest.mark.skipif(not HAVE_NVRTC, reason="needs NVRTC and the CUDA headers (nvidia-cuda-nvrtc-cu12, "
                    "nvidia-cuda-runtime-cu12)")
@pytest.mark.parametrize("part", cuda_q4.PARTS)
def test_the_cuda_q4_source_compiles_for_hopper_without_spills(tmp_path, part):
    """Each module (the core the engine loads, the extra forms the benches compare) holds its
    entries and no other, and compiles for sm_90 without a spill."""
    code = cuda_q4.ptx("compute_90", part=part)
    names = cuda_q4.ENTRIES if part == "core" else cuda_q4.EXTRA_ENTRIES
    assert set(re.findall(rb"\.entry (\w+)\(", code)) == set(names)
    assert code.count(b"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") >= 32
    built = ptxas.report(code, tmp_path)
    assert set(built) == {n.decode() for n in names}
    assert not any(spill for _, spill in built.values())


@pytest.mark.skipif(not HAVE_NVRTC, reason="needs NVRTC and the CUDA headers")
def test_every_kernel_waits_on_its_predecessor_and_the_ring_loads_weights_before_that():
    """PDL: every entry runs griddepcontrol.wait (before reading what a kernel wrote); the
    CTA forms issue their first ring blocks' weight loads before it (the streamed ones, d0,
    their cp.async copies), and x's after."""
    code = "".join(cuda_q4.ptx("compute_90", part=part).decode() for part in cuda_q4.PARTS)
    bodies = {b.split("(")[0]: b for b in code.split(".visible .entry ")[1:]}
    assert set(bodies) == {e.decode() for e in cuda_q4.ENTRIES + cuda_q4.EXTRA_ENTRIES}
    for name, body in bodies.items():
        assert "griddepcontrol.wait;" in body and "griddepcontrol.launch_dependents;" in body, name
        if name.startswith("q4_cta"):
            wait = body.index("griddepcontrol.wait;")
            weights = "cp.async.cg.shared.global" if name.endswith("_d0") else "ld.global.nc"
            assert body.index(weights) < wait, name  # the weights: before
            assert re.search(r"ld\.global\.nc\.v2\.f32", body[wait:]), name  # x: after


@pytest.mark.skipif(not HAVE_NVRTC, reason="needs NVRTC and the CUDA headers")
def test_the_preload_probe_fetches_its_weights_before_the_wait_and_x_after(tmp_path):
    """bench/preload_probe.py's kernel: both entries compile for sm_90 without a spill, each
    issues its cp.async weight copies before griddepcontrol.wait and loads x only after it."""
    from bench import preload_probe

    code = cuda_q4._compile("compute_90", preload_probe.SOURCE)
    built = ptxas.report(code, tmp_path)
    assert set(built) == {"pre_gemv16", "pre_gemv32"}
    assert not any(spill for _, spill in built.values())
    for body in code.decode().split(".visible .entry ")[1:]:
        wait = body.index("griddepcontrol.wait;")
        assert "cp.async.cg.shared.global" in body[:wait]
        assert "ld.global" in body[wait:] and "ld.global" not in body[:wait]


def test_the_launch_structures_match_the_driver_header(tmp_path):
    """cuLaunchKernelEx's CUlaunchConfig / CUlaunchAttribute as cuda_q4 lays them out in
    ctypes, and the PDL attribute's number, against cuda.h (compiled with the host's C
    compiler)."""
    import ctypes
    import shutil

    header, cc = cuda_q4._find("cuda.h"), shutil.which("cc") or shutil.which("gcc")
    if header is None or cc is None:
        pytest.skip("needs cuda.h (nvidia-cuda-runtime-cu12) and a C compiler")
    src = tmp_path / "layout.c"
    src.write_text("#include <stdio.h>\n#include <stddef.h>\n#include \"cuda.h\"\nint main(void) {"
                   " printf(\"%zu %zu %zu %zu %zu %zu %d\", sizeof(CUlaunchAttribute),"
                   " offsetof(CUlaunchAttribute, value), sizeof(CUlaunchConfig),"
                   " offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream),"
                   " offsetof(CUlaunchConfig, attrs),"
                   " (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION); return 0; }\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, f"-I{os.path.dirname(header)}", str(src), "-o", str(exe)], check=True,
                   capture_output=True)
    want = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    cfg = cuda_q4._LaunchConfig
    got = [ctypes.sizeof(cuda_q4._LaunchAttr), cuda_q4._LaunchAttr.value.offset, ctypes.sizeof(cfg),
           cfg.shared.offset, cfg.stream.offset, cfg.attrs.offset, cuda_q4._PDL_ATTR]
    assert [int(w) for w in want] == got


def test_importing_cuda_q4_leaves_triton_unimported():
    """tests/kernels/test_triton_kernels.py must set TRITON_INTERPRET before triton is first
    imported, and the suite imports this module earlier in the same process."""
    import sys

    code = "import sys, kernels.cuda_q4; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-500:]


def test_the_cuda_q4_linear_refuses_what_its_kernel_cannot_take():
    from kernels import q4_layout
    from kernels.linear import quantize_q4

    lin = q4_layout.repack(quantize_q4(torch.randn(64, 96, generator=torch.Generator().manual_seed(0))))
    with pytest.raises(ValueError, match="CUDA float32"):
        cuda_q4.linear(lin, torch.randn(2, 96), torch.empty(2, 64))
    with pytest.raises(ValueError, match="CUDA float32"):
        cuda_q4.swap_linear(lin, torch.randn(16, 96), torch.empty(16, 64))


def test_the_engine_keeps_to_triton_where_the_cuda_kernels_cannot_run(monkeypatch):
    """fits: CPU tensors, shapes the kernels do not take and devices where NVRTC or the
    headers are missing go to the Triton tile (one warning a device, then silence)."""
    from kernels import q4_layout
    from kernels.linear import quantize_q4

    lin = q4_layout.repack(quantize_q4(torch.randn(64, 128, generator=torch.Generator().manual_seed(0))))
    assert not cuda_q4.fits(lin, torch.randn(2, 128), torch.empty(2, 64))  # not CUDA
    calls = []

    def broken(device):
        calls.append(device)
        raise RuntimeError("cuda_q4: NVRTC not found")

    monkeypatch.setattr(cuda_q4, "_functions", broken)
    monkeypatch.setattr(cuda_q4, "_UNAVAILABLE", {})
    with pytest.warns(RuntimeWarning, match="NVRTC not found"):
        assert not cuda_q4.available(7)
    assert not cuda_q4.available(7) and calls == [7]  # tried once
    monkeypatch.setattr(cuda_q4, "_functions", lambda device: None)
    assert cuda_q4.available(3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (128, 2048), (151936 // 8, 2048)])
def test_the_cuda_q4_kernel_gives_the_decode_tile_bits(n, k):
    from bench.kernel_bench import rand_q4
    from kernels import q4_layout, triton_q4

    g = torch.Generator("cuda").manual_seed(n + k)
    lin = q4_layout.repack(rand_q4(n, k, g))
    for m in (1, 5, 8, 9, 16, 40):
        x = torch.randn(m, k, generator=g, device="cuda")
        res = torch.randn(m, n, generator=g, device="cuda")
        want = triton_q4.linear(lin, x, torch.full((m, n), float("nan"), device="cuda"), res,
                                tile=q4_layout.LINEAR_TILE, seq=False)
        stream = cuda_q4.STREAM
        for cols, warps, depth in ((8, 1, 8), (16, 1, 4), (16, 1, 8), (32, 1, 4), (32, 4, 4),
                                   (16, 1, stream), (32, 1, stream), (16, 2, stream)):
            blocks = k // 32 // lin.split
            if n % cols or (depth == stream and blocks % 16):
                continue
            got = cuda_q4.linear(lin, x, torch.full((m, n), float("nan"), device="cuda"), res,
                                 cols=cols, warps=warps, depth=depth)
            assert torch.equal(got, want), (m, cols, warps, depth, float((got - want).abs().max()))
        got = cuda_q4.linear(lin, x, torch.full((m, n), float("nan"), device="cuda"))
        want = triton_q4.linear(lin, x, torch.full((m, n), float("nan"), device="cuda"),
                                tile=q4_layout.LINEAR_TILE, seq=False)
        assert torch.equal(got, want), m
    assert lin.split == 1 or not any(t.any() for t in cuda_q4._TICKETS[lin].values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k,programs", [(5120, 2048, 256), (5120, 2048, 1024), (2048, 4096, 256),
                                          (128 * 37, 2048, 512), (128, 2048, 16), (128, 2048, 256),
                                          (2048, 4096, 1024)])
def test_the_cta_form_gives_the_decode_tile_bits(monkeypatch, n, k, programs):
    """q4_cta (a CTA a column tile's splits, merged in shared memory): the split programs'
    bits at 1-40 rows (one and several row tiles), with and without the residual, for split
    counts of 1-16 (the weights re-split for `programs`; above 8 the 512-thread entries); at
    1-8 rows of 16 or 32 columns a warp also with the MMA's operands swapped (SWAP_REGS), and
    streamed whole before the wait (depth STREAM, CTA_STREAM's form) where `cta_streams`."""
    from bench.kernel_bench import rand_q4
    from kernels import q4_layout, triton_q4

    g = torch.Generator("cuda").manual_seed(n + k + programs)
    lin = q4_layout.repack(rand_q4(n, k, g), q4_layout.LINEAR_TILE, programs)
    assert 1 <= lin.split <= cuda_q4.CTA_MAX_SPLIT
    nan = lambda m: torch.full((m, n), float("nan"), device="cuda")  # noqa: E731
    for m in (1, 5, 8, 9, 16, 40):
        x = torch.randn(m, k, generator=g, device="cuda")
        res = torch.randn(m, n, generator=g, device="cuda")
        want = triton_q4.linear(lin, x, nan(m), res, tile=q4_layout.LINEAR_TILE, seq=False)
        bare = triton_q4.linear(lin, x, nan(m), tile=q4_layout.LINEAR_TILE, seq=False)
        stream = cuda_q4.STREAM
        for cols, depth, sw in ((8, 8, False), (16, 8, False), (16, 4, False), (32, 4, False),
                                (8, 2, False), (16, 8, True), (16, 2, True), (32, 4, True),
                                (8, stream, False), (16, stream, True), (32, stream, False)):
            if n % cols or not cuda_q4.cta_takes(lin, cols) or (sw and m > 8):
                continue
            if depth == stream and not cuda_q4.cta_streams(lin, m, cols):
                continue
            monkeypatch.setattr(cuda_q4, "SWAP_REGS", sw)
            got = cuda_q4.linear(lin, x, nan(m), res, cols=cols, depth=depth, cta=True)
            assert torch.equal(got, want), (m, cols, depth, sw, lin.split, float((got - want).abs().max()))
            got = cuda_q4.linear(lin, x, nan(m), cols=cols, depth=depth, cta=True)
            assert torch.equal(got, bare), (m, cols, depth, sw, lin.split)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_chain_of_cuda_linears_under_pdl_in_a_graph_reads_each_input_after_it_is_written(monkeypatch):
    """Each layer's x is the previous CTA kernel's output; under PDL the next kernel starts
    while that one runs (its weights loading), so an x read before griddepcontrol.wait would
    see the last replay's values. Replays on fresh inputs equal plain launches, bit for bit."""
    from bench.kernel_bench import rand_q4
    from kernels import q4_layout

    g = torch.Generator("cuda").manual_seed(3)
    lins = [q4_layout.repack(rand_q4(2048, 2048, g)) for _ in range(6)]
    x0 = torch.randn(2, 2048, device="cuda")
    bufs = [torch.empty(2, 2048, device="cuda") for _ in lins]

    def chain():
        x = x0
        for lin, out in zip(lins, bufs):
            x = cuda_q4.linear(lin, x, out, residual=x)
        return x

    def plain(xin):
        monkeypatch.setattr(cuda_q4, "PDL", False)
        x0.copy_(xin)
        out = chain().clone()
        monkeypatch.setattr(cuda_q4, "PDL", True)
        return out

    monkeypatch.setattr(cuda_q4, "PDL", True)
    chain()  # loads the module outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(8):
        xin = torch.randn(2, 2048, generator=g, device="cuda")
        want = plain(xin)
        x0.copy_(xin)
        graph.replay()
        assert torch.equal(bufs[-1], want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (128, 2048), (128 * 37, 2048)])
def test_the_swapped_form_gives_the_decode_tile_bits(n, k):
    """Every (MT, NG, W) instance: 9-300 rows (token tiles of 16, 32, 64, partial ones,
    several a launch), with and without the residual, split and unsplit weights."""
    from bench.kernel_bench import rand_q4
    from kernels import q4_layout, triton_q4

    g = torch.Generator("cuda").manual_seed(n + k)
    lin = q4_layout.repack(rand_q4(n, k, g))
    for m in (9, 16, 17, 32, 40, 64, 100, 300):
        x = torch.randn(m, k, generator=g, device="cuda")
        res = torch.randn(m, n, generator=g, device="cuda")
        want = triton_q4.linear(lin, x, torch.full((m, n), float("nan"), device="cuda"), res,
                                tile=q4_layout.LINEAR_TILE, seq=False)
        bare = triton_q4.linear(lin, x, torch.full((m, n), float("nan"), device="cuda"),
                                tile=q4_layout.LINEAR_TILE, seq=False)
        ng = 2 if m <= 16 else 4 if m <= 32 else 8
        for mt, ng_, w in cuda_q4.SWAP_FORMS:
            if ng_ != ng or n % (16 * mt * w):
                continue
            got = cuda_q4.swap_linear(lin, x, torch.full((m, n), float("nan"), device="cuda"), res,
                                      mt=mt, warps=w)
            assert torch.equal(got, want), (m, mt, w, float((got - want).abs().max()))
            got = cuda_q4.swap_linear(lin, x, torch.full((m, n), float("nan"), device="cuda"),
                                      mt=mt, warps=w)
            assert torch.equal(got, bare), (m, mt, w)
    assert lin.split == 1 or not any(t.any() for t in cuda_q4._TICKETS[lin].values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("knobs,n,k,rows", [
    ((("triton_linear", "CUDA_MAX_ROWS", 8), ("cuda_q4", "DEPTH", 8), ("cuda_q4", "CTA", False)),
     2048, 4096, (1, 3, 8)),
    ((("triton_linear", "CUDA_MAX_ROWS", 8), ("cuda_q4", "DEPTH", cuda_q4.STREAM)), 2048, 4096,
     (1, 3, 8)),
    ((("triton_linear", "CUDA_SWAP_MIN_ROWS", 9),), 5120, 2048, (1, 8, 9, 33, 64, 200)),
    ((("triton_linear", "CUDA_MAX_ROWS", 8), ("cuda_q4", "CTA", True)), 5120, 2048, (1, 4, 8, 9)),
    ((("triton_linear", "CUDA_MAX_ROWS", 8), ("cuda_q4", "CTA", True)), 2048, 4096, (1, 8, 30))])
def test_the_linear_routed_to_a_cuda_form_keeps_its_bits(monkeypatch, knobs, n, k, rows):
    """triton_linear.linear with rows routed to the ring, the streamed, the CTA (the default)
    or the swapped form: the bits of the Triton path (rows outside the routed range stay on
    it)."""
    from bench.kernel_bench import rand_q4
    from kernels import q4_layout, triton_linear

    g = torch.Generator("cuda").manual_seed(n + len(rows))
    lin = q4_layout.repack(rand_q4(n, k, g))
    x = torch.randn(max(rows), k, generator=g, device="cuda")
    res = torch.randn(max(rows), n, generator=g, device="cuda")
    monkeypatch.setattr(triton_linear, "CUDA_MAX_ROWS", None)  # the Triton tile's bits
    want = triton_linear.linear(lin, x, residual=res)
    for module, name, value in knobs:
        monkeypatch.setattr({"triton_linear": triton_linear, "cuda_q4": cuda_q4}[module], name, value)
    for m in rows:
        got = triton_linear.linear(lin, x[:m], residual=res[:m])
        assert torch.equal(got, want[:m]), (knobs, m)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hidden,inter,experts", [(512, 256, 64), (2048, 768, 128)])
def test_the_direct_experts_in_the_cta_form_give_the_split_programs_bits(monkeypatch, hidden, inter,
                                                                          experts):
    """cuda_q4.experts_direct (triton_moe.CUDA_MAX_TOKENS): inter (SiLU·up in fp16, through
    Triton's own PTX for it) and y equal to the direct split programs' at 1-8 tokens, at
    several columns a warp and ring depths, split counts 4-8, with down's ids read before
    its PDL wait (EXPERT_EARLY), with the MMA's operands swapped (SWAP_REGS), and with
    gate_up's and / or down's splits streamed whole (EXPERT_STREAM / DOWN_STREAM, where they
    are groups of 4 blocks; down's copies before its wait)."""
    from bench.kernel_bench import rand_q4
    from kernels import moe_layout, triton_moe

    g = torch.Generator("cuda").manual_seed(hidden + experts)
    st = moe_layout.StackedExperts.stack(
        tuple((rand_q4(2 * inter, hidden, g), rand_q4(hidden, inter, g)) for _ in range(experts)))
    assert 1 < st.gu_split <= cuda_q4.EXPERT_MAX_SPLIT and 1 < st.down_split <= cuda_q4.EXPERT_MAX_SPLIT
    for t in (1, 3, 7, 8):
        x = torch.randn(t, hidden, generator=g, device="cuda")
        ids = torch.rand(t, experts, generator=g, device="cuda").topk(8, dim=-1).indices.int().contiguous()
        want_i = torch.full((t * 8, inter), float("nan"), device="cuda", dtype=torch.float16)
        want_y = torch.full((t * 8, hidden), float("nan"), device="cuda")
        monkeypatch.setattr(triton_moe, "CUDA_MAX_TOKENS", None)
        triton_moe.experts_forward(x, ids, st, want_i, want_y)
        assert not want_y.isnan().any()
        monkeypatch.setattr(triton_moe, "CUDA_MAX_TOKENS", 8)
        for cols, depth, early, sw, stream in (
                (16, 4, False, False, False), (8, 8, False, False, False),
                (32, 4, False, False, False), (16, 2, False, False, False),
                (16, 4, True, False, False), (16, 4, True, True, False),
                (16, 8, False, True, False), (32, 4, True, True, False),
                (16, 4, True, True, "gu dn"), (32, 4, False, False, "gu"),
                (16, 4, True, True, "dn"), (16, 2, False, False, "dn")):
            monkeypatch.setattr(cuda_q4, "EXPERT_STREAM", "gu" in (stream or ""))  # streamed where whole
            monkeypatch.setattr(cuda_q4, "DOWN_STREAM", "dn" in (stream or ""))
            monkeypatch.setattr(cuda_q4, "SWAP_REGS", sw)
            monkeypatch.setattr(cuda_q4, "EXPERT_COLS", cols)
            monkeypatch.setattr(cuda_q4, "EXPERT_DEPTH", depth)
            monkeypatch.setattr(cuda_q4, "EXPERT_EARLY", early)  # down's ids before the wait
            monkeypatch.setattr(cuda_q4, "PDL", depth == 4)  # the launch: no bit
            got_i = torch.full_like(want_i, float("nan"))
            got_y = torch.full_like(want_y, float("nan"))
            calls = []
            real = cuda_q4.experts_direct
            monkeypatch.setattr(cuda_q4, "experts_direct", lambda *a: calls.append(1) or real(*a))
            triton_moe.experts_forward(x, ids, st, got_i, got_y)
            monkeypatch.setattr(cuda_q4, "experts_direct", real)
            assert calls, "the CTA form should have run"
            assert torch.equal(got_i, want_i), (t, cols, depth, sw, "inter")
            assert torch.equal(got_y, want_y), (t, cols, depth, sw, float((got_y - want_y).abs().max()))


def test_the_ptx_is_compiled_once_and_kept_on_disk(monkeypatch, tmp_path):
    """ptx(): NVRTC runs once a (source, arch, toolchain); later calls and processes read the
    file; cache=False compiles and keeps nothing."""
    monkeypatch.setattr(cuda_q4, "CACHE_DIR", str(tmp_path))
    calls = []
    sources = []
    monkeypatch.setattr(cuda_q4, "_compile", lambda arch, source: calls.append(arch)
                        or sources.append(source) or f"ptx {arch}".encode())
    assert cuda_q4.ptx("compute_90") == b"ptx compute_90"
    assert cuda_q4.ptx("compute_90") == b"ptx compute_90" and calls == ["compute_90"]
    assert cuda_q4.ptx("compute_100") == b"ptx compute_100" and len(calls) == 2
    assert len(list(tmp_path.glob("cuda_q4-*.ptx"))) == 2
    assert cuda_q4.ptx("compute_90", cache=False) == b"ptx compute_90" and len(calls) == 3
    monkeypatch.setattr(cuda_q4, "SOURCE", cuda_q4.SOURCE + "// changed\n")
    cuda_q4.ptx("compute_90")
    assert len(calls) == 4  # another source: another file
    cuda_q4.ptx("compute_90", part="extra")
    assert len(calls) == 5 and sources[-1].endswith(cuda_q4.EXTRA) and sources[0].endswith(cuda_q4.CORE)


def test_the_extra_module_is_loaded_on_the_first_launch_of_one_of_its_kernels(monkeypatch):
    """_functions loads the core module (what the engine launches); the first lookup of an
    EXTRA entry loads the extra module once; an unknown name is a KeyError and loads nothing."""
    loads = []
    monkeypatch.setattr(cuda_q4, "_load", lambda cuda, device, part, names: loads.append((part, device))
                        or {n: part for n in names})
    fns = cuda_q4._Functions(None, 3)
    assert loads == [("core", 3)] and all(fns[n] == "core" for n in cuda_q4.ENTRIES)
    assert fns[b"q4_probe1"] == "extra" and fns[cuda_q4.EXTRA_ENTRIES[0]] == "extra"
    assert fns[b"q4_swap1_2_w4"] == "extra" and loads == [("core", 3), ("extra", 3)]
    with pytest.raises(KeyError):
        fns[b"q4_nothing"]
    assert len(loads) == 2 and not set(cuda_q4.ENTRIES) & set(cuda_q4.EXTRA_ENTRIES)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fused_one_token_experts_give_the_split_programs_bits(monkeypatch):
    """cuda_q4.experts_fused (FUSED_EXPERTS: one token's gate_up and down in one launch, an
    assignment a cluster of 16 CTAs) at the 30B's expert shape: inter and y equal to the
    direct split programs', eager and replayed in a CUDA graph with PDL, one token at a time."""
    from bench.kernel_bench import rand_q4
    from kernels import moe_layout, triton_moe

    hidden, inter, experts = 2048, 768, 128
    g = torch.Generator("cuda").manual_seed(17)
    st = moe_layout.StackedExperts.stack(
        tuple((rand_q4(2 * inter, hidden, g), rand_q4(hidden, inter, g)) for _ in range(experts)))
    if not cuda_q4.experts_fit(st, torch.empty(1, hidden, device="cuda")):
        pytest.skip("the CTA form does not load here")
    assert cuda_q4._fused_shape(st, 16) is not None, (st.gu_split, st.down_split)
    for _ in range(3):
        x = torch.randn(1, hidden, generator=g, device="cuda")
        ids = torch.rand(1, experts, generator=g, device="cuda").topk(8, dim=-1).indices.int().contiguous()
        want_i = torch.full((8, inter), float("nan"), device="cuda", dtype=torch.float16)
        want_y = torch.full((8, hidden), float("nan"), device="cuda")
        monkeypatch.setattr(triton_moe, "CUDA_MAX_TOKENS", None)
        triton_moe.experts_forward(x, ids, st, want_i, want_y)
        assert not want_y.isnan().any()
        got_i, got_y = torch.full_like(want_i, float("nan")), torch.full_like(want_y, float("nan"))
        cuda_q4.experts_fused(x, ids, st, got_i, got_y)
        assert torch.equal(got_i, want_i) and torch.equal(got_y, want_y), "eager"
        got_i.fill_(float("nan"))
        got_y.fill_(float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cuda_q4.experts_fused(x, ids, st, got_i, got_y)
            cuda_q4.experts_fused(x, ids, st, got_i, got_y)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got_i, want_i) and torch.equal(got_y, want_y), "graph"
        monkeypatch.setattr(triton_moe, "CUDA_MAX_TOKENS", 8)
        monkeypatch.setattr(cuda_q4, "FUSED_EXPERTS", True)
        got_y.fill_(float("nan"))
        triton_moe.experts_forward(x, ids, st, got_i, got_y)
        assert torch.equal(got_y, want_y), "routed"
        monkeypatch.setattr(cuda_q4, "FUSED_EXPERTS", False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_top_k_folded_into_the_fused_experts_gives_the_cuda_top_ks_bits(monkeypatch):
    """cuda_q4.FUSED_TOPK: the CUDA top-k picks the Triton top-k's experts (its weights within
    1e-6); the MoE at one token with the top-k folded into the fused experts equals the CUDA
    top-k then the two launches bit for bit, and a token's output alone equals its row among
    5 (the CUDA top-k at every token count)."""
    from bench.kernel_bench import rand_q4
    from kernels import moe_layout, q4_layout, triton_moe, triton_moe_route, triton_pdl

    hidden, inter, experts, k = 2048, 768, 128, 8
    g = torch.Generator("cuda").manual_seed(23)
    st = moe_layout.StackedExperts.stack(
        tuple((rand_q4(2 * inter, hidden, g), rand_q4(hidden, inter, g)) for _ in range(experts)))
    router = q4_layout.repack(rand_q4(experts, hidden, g))
    x = torch.randn(5, hidden, generator=g, device="cuda")
    if not cuda_q4.experts_fit(st, x):
        pytest.skip("the CTA form does not load here")
    logits = torch.randn(64, experts, generator=g, device="cuda")
    ids = {}
    for cuda_topk in (False, True):
        monkeypatch.setattr(cuda_q4, "FUSED_TOPK", cuda_topk)
        i, w = torch.empty(64, k, dtype=torch.int32, device="cuda"), torch.empty(64, k, device="cuda")
        if cuda_topk:
            cuda_q4.topk(logits, k, True, i, w)
        else:
            triton_moe_route._topk_kernel[(16,)](logits, i, w, 64, experts, logits.stride(0), TOPK=k,
                                                 NORM=True, BM=4, E_PAD=experts, num_warps=2,
                                                 **triton_pdl.launch(logits))
        ids[cuda_topk] = i, w
    assert torch.equal(ids[True][0], ids[False][0])
    assert torch.allclose(ids[True][1], ids[False][1], rtol=1e-6, atol=0)
    monkeypatch.setattr(cuda_q4, "FUSED_TOPK", True)
    outs = {}
    for fused in (False, True):
        monkeypatch.setattr(cuda_q4, "FUSED_EXPERTS", fused)
        outs[fused] = triton_moe.moe(x[:1], router, st, k, True)
    assert torch.equal(outs[True], outs[False])
    among = triton_moe.moe(x, router, st, k, True)
    assert torch.equal(among[:1], outs[True])
