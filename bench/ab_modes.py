"""Engine variants for side-by-side device runs (bench/gpu_ab.sh): `apply(mode)` sets the knobs a
mode string names (several may be combined, e.g. "pdl novarlen budget8192") before the engine
or its tests are built. Each knob is a module constant; nothing here changes the defaults."""

from __future__ import annotations

import re


def apply(mode: str) -> None:
    from kernels import q4_layout, triton_moe, triton_pdl

    triton_pdl.ENABLED = 'nopdl' not in mode
    if 'noswap' in mode:  # the router's split programs on the decode tile (q4_layout)
        q4_layout.SWAP_MIN_ROWS = None
    elif re.search(r'swap[0-9]+', mode):  # the swapped tile from N rows
        q4_layout.SWAP_MIN_ROWS = int(re.search(r'swap([0-9]+)', mode).group(1))
    if re.search(r'swapn[0-9]+', mode):  # ... for weights with fewer than N outputs
        q4_layout.SWAP_MAX_N = int(re.search(r'swapn([0-9]+)', mode).group(1))
    if re.search(r'(?<!e)cuda[0-9]+', mode):  # q4 linears of up to N rows on kernels/cuda_q4.py
        from kernels import triton_linear
        triton_linear.CUDA_MAX_ROWS = int(re.search(r'(?<!e)cuda([0-9]+)', mode).group(1))
    if re.search(r'cudan[0-9]+', mode):  # ... for weights of up to N outputs
        from kernels import triton_linear
        triton_linear.CUDA_MAX_N = int(re.search(r'cudan([0-9]+)', mode).group(1))
    if re.search(r'cudacols[0-9]+', mode):  # ... its columns a warp
        from kernels import cuda_q4
        cuda_q4.COLS = int(re.search(r'cudacols([0-9]+)', mode).group(1))
    if 'fillcols' in mode:  # ... 8 for weights whose 16-column CTAs do not fill the SMs (o;
        from kernels import cuda_q4  # the default since v26), nofillcols: 16 (v25's)
        cuda_q4.FILL_COLS = 'nofillcols' not in mode
    if re.search(r'cudad[0-9]+', mode) or 'cudastream' in mode:
        from kernels import cuda_q4  # ... its form: a ring of N blocks, or streamed
        cuda_q4.DEPTH = (int(re.search(r'cudad([0-9]+)', mode).group(1)) if 'cudad' in mode
                         else cuda_q4.STREAM)
    if 'nocuda' in mode:  # q4 linears on the Triton tile at every row count (v16's engine)
        from kernels import triton_linear
        triton_linear.CUDA_MAX_ROWS = None
    if re.search(r'ecuda[0-9]+', mode):  # direct experts of up to N tokens on cuda_q4's CTA form
        triton_moe.CUDA_MAX_TOKENS = int(re.search(r'ecuda([0-9]+)', mode).group(1))
    if re.search(r'ecols[0-9]+', mode):  # ... its columns a warp
        from kernels import cuda_q4
        cuda_q4.EXPERT_COLS = int(re.search(r'ecols([0-9]+)', mode).group(1))
    if re.search(r'edepth[0-9]+', mode):  # ... its blocks in flight
        from kernels import cuda_q4
        cuda_q4.EXPERT_DEPTH = int(re.search(r'edepth([0-9]+)', mode).group(1))
    if 'cudarouter' in mode:  # ... the router (128 outputs) too, in the CTA form's 16 splits
        from kernels import triton_linear  # (the default since v18)
        triton_linear.CUDA_MIN_N = 1
    if 'tritonrouter' in mode:  # the router on the swapped Triton tile (v17's engine)
        from kernels import triton_linear
        triton_linear.CUDA_MIN_N = None
    if 'swregs' in mode:  # cuda_q4's CTA forms at <= 8 rows with the MMA's operands swapped
        from kernels import cuda_q4  # (SWAP_REGS: the weights as A; noswregs: off)
        cuda_q4.SWAP_REGS = 'noswregs' not in mode
    if re.search(r'attnprobe[0-9]', mode):  # the attention with parts of its key loop left
        from kernels import triton_attention  # out (PROBE; wrong values but 4: timing only)
        triton_attention.PROBE = int(re.search(r'attnprobe([0-9])', mode).group(1))
    if 'kvpf' in mode:  # paged attention prefetching its split's K / V into L2 before its
        from kernels import triton_attention  # wait: at every token count (nokvpf: none)
        triton_attention.PREFETCH_KV = None if 'nokvpf' in mode else 1 << 30
    if 'cudapdl' in mode:  # cuda_q4's kernels launched with PDL (the default since v19), or
        from kernels import cuda_q4  # plainly (nocudapdl)
        cuda_q4.PDL = 'nocudapdl' not in mode
    if 'estream' in mode:  # cuda_q4's one-token gate_up with each warp's split streamed whole
        from kernels import cuda_q4  # (EXPERT_STREAM; noestream: the ring)
        cuda_q4.EXPERT_STREAM = 'noestream' not in mode
    if 'efused' in mode:  # cuda_q4's one-token experts in one cluster launch (FUSED_EXPERTS;
        from kernels import cuda_q4  # noefused: two launches); efusedk: the top-k folded in,
        cuda_q4.FUSED_EXPERTS = 'noefused' not in mode  # the CUDA top-k at every token count
        cuda_q4.FUSED_TOPK = 'efusedk' in mode  # (FUSED_TOPK)
    if 'dstream' in mode:  # cuda_q4's one-token down with each warp's split streamed whole,
        from kernels import cuda_q4  # its copies before the wait (DOWN_STREAM; nodstream: the ring)
        cuda_q4.DOWN_STREAM = 'nodstream' not in mode
    if 'cstream' in mode:  # cuda_q4's CTA form at <= 8 rows with each warp's split streamed
        from kernels import cuda_q4  # whole before the wait (CTA_STREAM; nocstream: the ring)
        cuda_q4.CTA_STREAM = 'nocstream' not in mode
    if 'nocta' in mode:  # cuda_q4's split programs with the ticket merge, not the CTA form
        from kernels import cuda_q4
        cuda_q4.CTA = False
    if re.search(r'csw[0-9]+', mode):  # q4 linears from N rows on cuda_q4's swapped form
        from kernels import triton_linear
        triton_linear.CUDA_SWAP_MIN_ROWS = int(re.search(r'csw([0-9]+)', mode).group(1))
    if re.search(r'cswmt[0-9]+', mode):  # ... its m16 feature tiles a warp
        from kernels import cuda_q4
        cuda_q4.SWAP_MT = int(re.search(r'cswmt([0-9]+)', mode).group(1))
    if re.search(r'csww[0-9]+', mode):  # ... its warps a CTA
        from kernels import cuda_q4
        cuda_q4.SWAP_WARPS = int(re.search(r'csww([0-9]+)', mode).group(1))
    if 'novarlen' in mode:  # prefill attention: a FlashAttention call per piece per stream (v10)
        from kernels import prefill
        prefill.VARLEN = False
    if re.search(r'minpos[0-9]+', mode):  # prompt positions below N on the paged kernel (256)
        from kernels import prefill
        prefill.MIN_POSITION = int(re.search(r'minpos([0-9]+)', mode).group(1))
    if re.search(r'enreg[0-9]+', mode):  # the seq expert kernels' register cap (both)
        triton_moe.SEQ_MAXNREG = triton_moe.DOWN_MAXNREG = int(re.search(r'enreg([0-9]+)', mode).group(1))
    if 'noeprefetch' in mode:  # no L2 prefetch of the direct down programs' weights
        triton_moe.PREFETCH_BLOCKS = None
    elif re.search(r'eprefetch[0-9]+', mode):  # ... or this many blocks of it
        triton_moe.PREFETCH_BLOCKS = int(re.search(r'eprefetch([0-9]+)', mode).group(1))
    if 'even' in mode:  # the q4 K loops of weights that fill their tiles without k / column
        from kernels import triton_q4  # masks (EVEN_STEPS; noeven: masked)
        triton_q4.EVEN_STEPS = 'noeven' not in mode
    if 'inter32' in mode:  # q4 experts' intermediate in fp32 on the Triton kernels (INTER_F32;
        triton_moe.INTER_F32 = 'nointer32' not in mode  # nointer32: fp16 everywhere)
    if 'skip' in mode:  # ablations: timing only, the tokens are wrong (see `_skip`)
        _skip(mode)
    if 'fusedmoe' in mode:  # direct experts and combine in one launch (triton_moe.FUSED)
        triton_moe.FUSED = True
    if 'nomaxnreg' in mode:  # the seq expert kernels at the compiler's register count (v8)
        triton_moe.SEQ_MAXNREG = triton_moe.DOWN_MAXNREG = None
    if re.search(r'downnreg[0-9]+', mode):  # the down kernel's own cap (0: none)
        triton_moe.DOWN_MAXNREG = int(re.search(r'downnreg([0-9]+)', mode).group(1)) or None
    if re.search(r'mp[0-9]+', mode):  # q4 weights split for this many programs at M = 1
        q4_layout.MAX_PROGRAMS = int(re.search(r'mp([0-9]+)', mode).group(1))
    if re.search(r'maxsplit[0-9]+', mode):  # ... into at most N splits (16)
        q4_layout.MAX_SPLIT = int(re.search(r'maxsplit([0-9]+)', mode).group(1))
    if re.search(r'attnsplit[0-9]+', mode):  # keys per split of the paged attention (256; other bits)
        from kernels import triton_attention  # (replica/memory.py's estimates read it too)
        triton_attention.SPLIT = int(re.search(r'attnsplit([0-9]+)', mode).group(1))
    if re.search(r'hsplit[0-9]+', mode):  # a kv head's query heads dealt over programs (same bits)
        from kernels import triton_attention
        triton_attention.HEAD_SPLIT_PROGRAMS = int(re.search(r'hsplit([0-9]+)', mode).group(1))
    if 'eidsfirst' in mode:  # the one-token down reads its ids and first weights before the
        from kernels import cuda_q4  # wait (the default since v21; noeidsfirst: after it)
        cuda_q4.EXPERT_EARLY = 'noeidsfirst' not in mode
    if 'early' in mode:  # inputs older than the predecessor's loaded before the PDL wait (the
        from kernels import triton_pdl  # default since v21; noearly: after it)
        triton_pdl.EARLY_INPUTS = 'noearly' not in mode
    if re.search(r'eprog[0-9]+', mode):  # the experts' K splits counted for N programs (64)
        from kernels import moe_layout
        moe_layout.EXPERT_PROGRAMS = int(re.search(r'eprog([0-9]+)', mode).group(1))
    if re.search(r'egu[0-9]+', mode):  # ... gate_up's alone
        from kernels import moe_layout
        moe_layout.GU_PROGRAMS = int(re.search(r'egu([0-9]+)', mode).group(1))
    if re.search(r'edn[0-9]+', mode):  # ... down's alone
        from kernels import moe_layout
        moe_layout.DOWN_PROGRAMS = int(re.search(r'edn([0-9]+)', mode).group(1))
    if re.search(r'attnbn[0-9]+', mode):  # keys a tile of the bf16 paged attention (128; other bits)
        from kernels import triton_attention
        triton_attention.BLOCK_N_BF16 = int(re.search(r'attnbn([0-9]+)', mode).group(1))
    if re.search(r'attn[0-9]+_[0-9]+', mode):  # paged attention split-kernel launch: warps_stages
        from kernels import triton_attention
        w, st = re.search(r'attn([0-9]+)_([0-9]+)', mode).groups()
        triton_attention.WARPS, triton_attention.STAGES = int(w), int(st)
    if 'nodense' in mode:  # no weights dequantized once per call: the q4 tiles everywhere (v9)
        q4_layout.DENSE_MIN_ROWS = triton_moe.DENSE_MIN_TOKENS = None
    elif re.search(r'(?<!l)dense[0-9]+', mode):  # rows / tokens from which the dense path runs
        q4_layout.DENSE_MIN_ROWS = triton_moe.DENSE_MIN_TOKENS = int(re.search(r'(?<!l)dense([0-9]+)', mode).group(1))
    if re.search(r'ldense[0-9]+', mode):  # rows from which the linear alone runs dense
        q4_layout.DENSE_MIN_ROWS = int(re.search(r'ldense([0-9]+)', mode).group(1))
    if re.search(r'dtile[0-9x]+w[0-9]+s[0-9]+', mode):  # the linear's dense tile below DENSE_WIDE_ROWS
        q4_layout.DENSE_TILE = q4_layout.Q4Tile.parse(re.search(r'dtile([0-9x]+w[0-9]+s[0-9]+)', mode).group(1))
    if re.search(r'etile[0-9x]+w[0-9]+s[0-9]+', mode):  # the q4 experts' tile (stacked with it)
        from kernels import moe_layout
        tile = q4_layout.Q4Tile.parse(re.search(r'etile([0-9x]+w[0-9]+s[0-9]+)', mode).group(1))
        moe_layout.Q4_EXPERT_TILE = tile
        if tile.nb != triton_moe.DENSE_GATE_UP[0].nb:  # the dense prefill path counts in its BK
            triton_moe.DENSE_MIN_TOKENS = None
    if 'nomid' in mode:  # grouped seq expert launches of 9-32 tokens on the one-warp tile (v11)
        triton_moe.MID_TILE = None
    if 'nooverlap' in mode:  # a step's events delivered after it, not while the next one runs
        from replica.config import EngineConfig
        EngineConfig.use_overlap_events = property(lambda self: False)
    if 'nolookahead' in mode:  # no decode step launched before the one before has its tokens
        from replica.config import EngineConfig
        EngineConfig.use_lookahead = property(lambda self: False)
    if re.search(r'budget[0-9]+', mode):  # a CUDA step's default token budget
        from replica import config
        config.CUDA_BATCH_TOKENS = int(re.search(r'budget([0-9]+)', mode).group(1))
    if 'grouped' in mode:  # every MoE launch groups its assignments by expert first (v8)
        triton_moe.DIRECT_MAX_TOKENS = 0
    if 'wide32' in mode:  # the 32-row tile (parallel splits) from 32 rows
        q4_layout.WIDE_MIN_ROWS = 32
    if 'splitrows' in mode:  # every batch size on the decode tile with parallel K splits (v7)
        q4_layout.SEQ_MIN_ROWS = q4_layout.WIDE_MIN_ROWS = 1 << 30
        triton_moe.SEQ_MIN_TOKENS = triton_moe.WIDE_MIN_TOKENS = 1 << 30


def _skip(mode: str) -> None:
    """Ablations for where a one-token step's time goes on the chain (GPU_NOTES v22): a kernel
    family launches nothing, so the step without it says what it costs in the PDL graph, waits
    and boundaries included (an eager profile counts each kernel alone). The outputs are
    wrong but finite: a skipped kernel's output is its input (`skipcombine`: the residual alone,
    `skipexperts`: gate_up, down and the combine, `skipmoe`: the whole MoE), fixed (`skiptopk`:
    the router's logits unread, ids and weights fixed) or zeros allocated once a shape
    (`skipnorm`; `skiprope`: q, nothing written to the pool; `skipattn`). Timing only: never
    with the bitwise tests."""
    import torch

    from kernels import ops, triton_moe_route

    zeros: dict = {}

    def zeros_of(shape, device) -> torch.Tensor:
        key = (tuple(shape), str(device))
        if key not in zeros:
            zeros[key] = torch.zeros(shape, dtype=torch.float32, device=device)
        return zeros[key]

    if 'skipnorm' in mode:  # every RMSNorm (the q / k norms are the rope kernel's): zeros, as
        ops.rms_norm = lambda x, weight, eps: zeros_of(x.shape, x.device)  # x overflows
    if 'skiprope' in mode:
        ops.qkv_rope_store = lambda qkv, positions, cos, sin, q_norm, k_norm, eps, slots, \
            k_cache, v_cache, num_heads: zeros_of((qkv.shape[0], num_heads, k_cache.shape[-1]),
                                                  qkv.device)
    if 'skipattn' in mode:
        ops.paged_attention = lambda q, k_cache, v_cache, block_tables, tok_row, ctx_lens, \
            scale: zeros_of(q.shape, q.device)
    def residual_only(y, wts, out, residual=None):  # the combine's output without its sum
        return residual if residual is not None else out

    if 'skipcombine' in mode:
        triton_moe_route.combine = residual_only
    if 'skipexperts' in mode:  # gate_up and down (and the combine: y is never written)
        from kernels import triton_moe
        triton_moe.experts_forward = lambda *args, **kwargs: None
        triton_moe_route.combine = residual_only
    if 'skiptopk' in mode:  # the top-k alone: fixed ids (token t's rank r: expert (t k + r) mod E)
        from kernels import triton_moe
        from kernels.triton_linear import linear

        def moe(x, router, experts, top_k, norm_topk_prob, residual=None):
            t, dev, e = x.shape[0], x.device, router.out_features
            key = ("ids", t, top_k, str(dev))
            if key not in zeros:
                zeros[key] = (torch.arange(t * top_k, device=dev, dtype=torch.int32) % e).view(t, top_k)
                zeros[key + ("w",)] = torch.full((t, top_k), 1.0 / top_k, device=dev)
            ids, wts = zeros[key], zeros[key + ("w",)]
            linear(router, x, zeros_of((t, e), dev),
                   tile=None if router.fmt == "q4" else triton_moe_route.ROUTER_TILE)
            inter = torch.empty(t * top_k, experts.inter, dtype=triton_moe.inter_dtype(experts),
                                device=dev)
            y = torch.empty(t * top_k, experts.hidden, dtype=torch.float32, device=dev)
            triton_moe.experts_forward(x, ids, experts, inter, y)
            out = torch.empty(t, experts.hidden, dtype=torch.float32, device=dev)
            return triton_moe_route.combine(y, wts, out, residual)
        ops.moe = moe
    if 'skipmoe' in mode:  # router, top-k, experts and combine
        ops.moe = lambda x, router, experts, top_k, norm_topk_prob, residual=None: residual
