"""bench/ab_modes.py: the mode strings of side-by-side device runs set the knobs they name
(each case in a process of its own: the knobs are module globals, and the modes import Triton)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _knobs(mode: str, expr: str) -> list[str]:
    code = (f"from bench.ab_modes import apply\napply({mode!r})\n"
            "from kernels import cuda_q4, moe_layout, q4_layout, triton_attention, "
            "triton_linear, triton_moe, triton_moe_route, triton_norm, triton_pdl, triton_q4\n"
            "from replica import memory\n"
            f"print({expr})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


@pytest.mark.parametrize("mode,want", [("pdl", "8 16384 16 8 True True True"),
                                       ("pdl_cuda16_cudacols32_cudastream_cudan200000",
                                        "16 200000 32 0 True True True"),
                                       ("pdl_nocuda_cudacols8_cudad4_nocta", "None 16384 8 4 False True True"),
                                       ("pdl_swregs_nofillcols", "8 16384 16 8 True True False"),
                                       ("pdl_noswregs", "8 16384 16 8 True False True")])
def test_the_cuda_modes_route_rows_to_the_cuda_kernel(mode, want):
    assert _knobs(mode, "triton_linear.CUDA_MAX_ROWS, triton_linear.CUDA_MAX_N, cuda_q4.COLS, "
                        "cuda_q4.DEPTH, cuda_q4.CTA, cuda_q4.SWAP_REGS, cuda_q4.FILL_COLS") == want.split()


@pytest.mark.parametrize("mode,want", [("pdl", "False True False False False False"),
                                       ("pdl_cstream", "True True False False False False"),
                                       ("pdl_nocstream_nocta_estream", "False False True False False False"),
                                       ("pdl_cstream_noestream_dstream", "True True False True False False"),
                                       ("pdl_estream_nodstream_efused", "False True True False True False"),
                                       ("pdl_efusedk", "False True False False True True")])
def test_the_streamed_cta_modes_set_their_knobs(mode, want):
    assert _knobs(mode, "cuda_q4.CTA_STREAM, cuda_q4.CTA, cuda_q4.EXPERT_STREAM, "
                        "cuda_q4.DOWN_STREAM, cuda_q4.FUSED_EXPERTS, cuda_q4.FUSED_TOPK") == want.split()


@pytest.mark.parametrize("mode,want", [("pdl", "None 2 4"), ("pdl_csw16_cswmt1_csww8", "16 1 8"),
                                       ("pdl_noswap_csw9", "9 2 4")])
def test_the_swapped_cuda_modes_route_rows_to_the_swapped_form(mode, want):
    assert _knobs(mode, "triton_linear.CUDA_SWAP_MIN_ROWS, cuda_q4.SWAP_MT, "
                        "cuda_q4.SWAP_WARPS") == want.split()


@pytest.mark.parametrize("mode,want", [("pdl", "256 4 2 0"),
                                       ("pdl_attnsplit512_attn8_3", "512 8 3 0"),
                                       ("pdl_attnprobe3", "256 4 2 3")])
def test_the_attention_modes_set_the_kernel(mode, want):
    assert _knobs(mode, "triton_attention.SPLIT, triton_attention.WARPS, "
                        "triton_attention.STAGES, triton_attention.PROBE") == want.split()


@pytest.mark.parametrize("mode,want", [("pdl", "16x64x64w1s3 512 128 128"),
                                       ("pdl_etile16x64x32w1s4", "16x64x32w1s4 None 128 128"),
                                       ("pdl_etile16x64x64w1s2_enreg96", "16x64x64w1s2 512 96 96")])
def test_the_expert_modes_set_the_stacking_tile_and_the_register_cap(mode, want):
    assert _knobs(mode, "moe_layout.Q4_EXPERT_TILE.name, triton_moe.DENSE_MIN_TOKENS, "
                        "triton_moe.SEQ_MAXNREG, triton_moe.DOWN_MAXNREG") == want.split()


@pytest.mark.parametrize("mode,want", [("pdl", "4 False True True"),
                                       ("pdl_noeprefetch_fusedmoe", "None True True True"),
                                       ("pdl_eprefetch2_inter32", "2 False True True"),
                                       ("pdl_even_nointer32", "4 False False True"),
                                       ("pdl_noeven_inter32", "4 False True False")])
def test_the_expert_modes_set_the_prefetch_the_fused_launch_the_intermediate_and_the_masks(mode, want):
    assert _knobs(mode, "triton_moe.PREFETCH_BLOCKS, triton_moe.FUSED, "
                        "triton_moe.INTER_F32, triton_q4.EVEN_STEPS") == want.split()


@pytest.mark.parametrize("mode,want", [("pdl", "384 16"), ("pdl_mp1024_maxsplit8", "1024 8")])
def test_the_split_modes_set_the_programs_and_the_split_cap(mode, want):
    assert _knobs(mode, "q4_layout.MAX_PROGRAMS, q4_layout.MAX_SPLIT") == want.split()


@pytest.mark.parametrize("mode,want", [("pdl", "1 16 4 8 True True 64"),
                                       ("pdl_ecuda0", "0 16 4 8 True True 64"),
                                       ("pdl_ecuda4_ecols32_edepth2_eidsfirst_eprog256",
                                        "4 32 2 8 True True 256"),
                                       ("pdl_noeidsfirst", "1 16 4 8 False True 64"),
                                       ("pdl_noearly", "1 16 4 8 True False 64")])
def test_the_expert_cuda_and_early_modes_set_their_knobs_and_leave_the_linear_alone(mode, want):
    assert _knobs(mode, "triton_moe.CUDA_MAX_TOKENS, cuda_q4.EXPERT_COLS, cuda_q4.EXPERT_DEPTH, "
                        "triton_linear.CUDA_MAX_ROWS, cuda_q4.EXPERT_EARLY, "
                        "triton_pdl.EARLY_INPUTS, moe_layout.EXPERT_PROGRAMS") == want.split()


@pytest.mark.parametrize("mode,want", [("pdl", "None None"), ("pdl_egu96_edn32", "96 32")])
def test_the_expert_split_modes_set_each_gemms_program_count(mode, want):
    assert _knobs(mode, "moe_layout.GU_PROGRAMS, moe_layout.DOWN_PROGRAMS") == want.split()


@pytest.mark.parametrize("mode,want", [("pdl", "128 4 2"), ("pdl_attnbn64_attn8_3", "64 8 3")])
def test_the_key_tile_modes_set_their_knobs(mode, want):
    assert _knobs(mode, "triton_attention.BLOCK_N_BF16, triton_attention.WARPS, "
                        "triton_attention.STAGES") == want.split()


@pytest.mark.parametrize("mode,want", [("pdl", "1"), ("pdl_cudarouter", "1"),
                                       ("pdl_tritonrouter", "None")])
def test_the_router_mode_lowers_the_cuda_linears_output_floor(mode, want):
    assert _knobs(mode, "triton_linear.CUDA_MIN_N") == want.split()


@pytest.mark.parametrize("mode,want", [("pdl", "None 256 1"), ("pdl_hsplit128", "128 256 1"),
                                       ("pdl_kvpf", "None 256 1073741824"),
                                       ("pdl_nokvpf", "None 256 None")])
def test_the_head_split_and_prefetch_modes_leave_the_split_alone(mode, want):
    assert _knobs(mode, "triton_attention.HEAD_SPLIT_PROGRAMS, triton_attention.SPLIT, "
                        "triton_attention.PREFETCH_KV") == want.split()


@pytest.mark.parametrize("mode,want", [("pdl", "True True"),
                                       ("pdl_nocudapdl", "True False"),
                                       ("nopdl_cudapdl", "False True")])
def test_the_cuda_launch_modes_leave_the_triton_launches_alone(mode, want):
    assert _knobs(mode, "triton_pdl.ENABLED, cuda_q4.PDL") == want.split()



def test_the_skip_modes_replace_a_kernel_family_by_its_input_or_cached_zeros():
    code = ("import torch\nfrom bench.ab_modes import apply\n"
            "apply('pdl_skipnorm_skipattn_skipcombine_skipmoe')\n"
            "from kernels import ops, triton_moe_route\n"
            "x, r = torch.randn(3, 8), torch.randn(2, 8)\n"
            "n = ops.rms_norm(x, torch.ones(8), 1e-6)\n"
            "a = ops.paged_attention(torch.randn(2, 4, 16), None, None, None, None, None, 1.0)\n"
            "c = triton_moe_route.combine(torch.randn(4, 8), torch.ones(2, 2), torch.empty(2, 8), r)\n"
            "print(float(n.abs().sum()), tuple(n.shape), float(a.abs().sum()), tuple(a.shape),\n"
            "      c is r, ops.moe(x, None, None, 2, True, r) is r,\n"
            "      ops.rms_norm(x, None, 0.0) is n,\n"
            "      ops.norm_moe(x, torch.ones(8), 1e-6, None, None, 2, True) is x)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0.0", "(3,", "8)", "0.0", "(2,", "4,", "16)", "True", "True",
                                  "True", "True"]  # (the model's MoE entry, norm_moe, skipped too)


@pytest.mark.parametrize("mode,want", [("pdl", "True 16"),
                                       ("pdl_fillcols", "True 16"),
                                       ("pdl_nofillcols", "False 16")])
def test_the_v22_experiment_modes_turn_on_their_knob_alone(mode, want):
    """8 columns only where 16 do not fill the SMs (COLS stays) by default and under fillcols;
    nofillcols: 16 there too."""
    assert _knobs(mode, "cuda_q4.FILL_COLS, cuda_q4.COLS") == want.split()
