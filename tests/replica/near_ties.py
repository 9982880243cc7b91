"""Comparing greedy runs of one model under two numerics (KV dtype, device): they may part
only where the reference run was a near-tie (not a test module)."""

from __future__ import annotations

import torch

from kernels import ops
from replica.kv import KVCache
from replica.models.transformer import ForwardBatch, Transformer


def all_logits(loaded, ids: list[int], kv_dtype: torch.dtype) -> torch.Tensor:
    """Logits [len(ids), vocab] of one prefill of ids over a pool of kv_dtype, and the router
    probabilities [layers * len(ids), experts] seen on the way (MoE)."""
    model = Transformer(loaded.config, loaded.weights)
    cfg, n, bs = loaded.config, len(ids), 16
    nb = -(-n // bs)
    kv = KVCache(cfg.num_layers, nb, bs, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
    pos = torch.arange(n)
    batch = ForwardBatch(token_ids=torch.tensor(ids), positions=pos, slots=pos.clone(),
                         block_tables=torch.arange(nb, dtype=torch.int32)[None],
                         tok_row=torch.zeros(n, dtype=torch.int32),
                         ctx_lens=(pos + 1).to(torch.int32), logit_rows=pos.clone())
    routers = []
    softmax = ops.softmax
    ops.softmax = lambda x: routers.append(softmax(x)) or routers[-1]  # the MoE router's call
    try:
        logits, _ = model.forward(batch, kv)
    finally:
        ops.softmax = softmax
    return logits, torch.cat(routers) if routers else None


def assert_parts_only_at_near_ties(loaded, prompts, ref_runs, runs, min_agree: float = 0.6,
                                   tie: float = 0.01, ref_kv_dtype=torch.float32) -> None:
    """ref_runs/runs: greedy tokens per prompt under the reference numerics (CPU, fp32 pool) and
    the other. They agree until a step where the reference run is a near-tie — its top-2 logits
    closer than `tie` of the logit range, or, for MoE, a router's k-th and (k+1)-th expert
    probabilities as close — and at least min_agree of all steps agree."""
    cfg = loaded.config
    agreed = total = 0
    for prompt, a, b in zip(prompts, ref_runs, runs):
        assert len(a) == len(b)
        total += len(a)
        d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        agreed += d
        if d == len(a):
            continue
        logits, probs = all_logits(loaded, list(prompt) + a[:d], ref_kv_dtype)
        top2 = logits[-1].topk(2).values
        near_tie = float(top2[0] - top2[1]) < tie * float(logits.abs().max())
        if probs is not None:
            k = cfg.num_experts_per_tok
            pk = probs.topk(k + 1, dim=-1).values  # [layers * len(ids), k + 1]
            near_tie |= float((pk[:, k - 1] - pk[:, k]).min()) < tie * float(pk[:, 0].min())
        assert near_tie, f"the runs part at step {d} of prompt {prompt[:8]}... with no near-tie"
    assert agreed >= min_agree * total, f"only {agreed} of {total} steps agree"
