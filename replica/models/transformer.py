"""The decoder forward pass (llama / qwen3 / qwen3_moe) over a flat batch of tokens.

Every op is row-local: projections, norms and activations work per token; attention reads
only the token's own stream's KV. So a token's result depends only on its stream, never on
the batch or on how its prompt was chunked (DESIGN.md, principle 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import ops, prefill
from kernels.linear import Linear, concat_rows
from replica.kv import KVCache
from replica.models.spec import LayerWeights, ModelConfig, ModelWeights


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    """A step's tokens, flattened. T tokens from S streams."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64: block * block_size + offset where the token's K/V go
    block_tables: torch.Tensor  # [S, MB] int32
    tok_row: torch.Tensor  # [T] int32: the block-table row of each token
    ctx_lens: torch.Tensor  # [T] int32: keys visible to each token (position + 1)
    logit_rows: torch.Tensor  # [L] int64: tokens whose next-token logits are wanted
    hidden_rows: torch.Tensor | None = None  # [E] int64: tokens whose final hidden state is wanted
    # prompt tokens that attend through kernels/prefill.py (the rest use the paged kernel)
    prefill: tuple["PrefillSpan", ...] = ()
    paged_rows: torch.Tensor | None = None  # [P] int64: the other tokens (with prefill spans)
    paged_tok_row: torch.Tensor | None = None  # [P] int32: their tok_row
    paged_ctx_lens: torch.Tensor | None = None  # [P] int32: their ctx_lens


@dataclass(frozen=True)
class PrefillSpan:
    """Tokens [row, row + n) of the batch: positions start .. start+n-1 of block-table row
    `table`, attending through kernels.prefill."""

    row: int
    n: int
    start: int
    table: int


@dataclass(frozen=True, eq=False)
class _Layer:
    attn_norm: torch.Tensor
    qkv: Linear  # q, k, v rows fused
    o: Linear
    mlp_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    gate_up: Linear | None  # gate and up rows fused
    down: Linear | None
    router: Linear | None
    experts: tuple[tuple[Linear, Linear], ...]  # (gate_up, down) per expert (CPU)
    moe: object | None = None  # CUDA: the experts stacked for ops.moe (kernels/triton_moe.py)


def rope_tables(cfg: ModelConfig, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position, head_dim] in fp32, computed as Hugging Face does."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    pos = torch.arange(cfg.max_position, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # [P, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [P, d]
    return emb.cos().to(device), emb.sin().to(device)


class Transformer:
    """Holds fused weights and RoPE tables; forward() runs one step."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, device: str = "cpu") -> None:
        self.cfg = cfg
        self.device = device
        # CUDA runs fused kernels (q/k norm + RoPE + KV write, residual epilogues, ops.moe);
        # CPU runs the separate ops, unchanged
        self.fused = device != "cpu"
        self.embed = ops.prepare_linear(weights.embed, device)
        self.lm_head = (self.embed if weights.lm_head is weights.embed
                        else ops.prepare_linear(weights.lm_head, device))
        self.final_norm = weights.final_norm.to(device)
        self.layers = tuple(self._fuse(layer) for layer in weights.layers)
        self.cos, self.sin = rope_tables(cfg, device)
        self.scale = cfg.head_dim ** -0.5

    def _fuse(self, w: LayerWeights) -> _Layer:
        dev = self.device
        t = lambda x: None if x is None else x.to(device=dev, dtype=torch.float32)  # noqa: E731
        lin = lambda x: ops.prepare_linear(x, dev)  # noqa: E731
        dense = w.gate is not None
        experts = tuple((concat_rows([e.gate, e.up]), e.down) for e in w.experts)
        stacked = ops.prepare_experts(experts, dev) if experts else None
        return _Layer(
            attn_norm=t(w.attn_norm), qkv=lin(concat_rows([w.q, w.k, w.v])), o=lin(w.o),
            mlp_norm=t(w.mlp_norm), q_norm=t(w.q_norm), k_norm=t(w.k_norm),
            gate_up=lin(concat_rows([w.gate, w.up])) if dense else None,
            down=lin(w.down) if dense else None,
            router=None if dense else lin(w.router),
            experts=tuple((lin(g), lin(d)) for g, d in experts) if stacked is None else (),
            moe=stacked,
        )

    @torch.inference_mode()
    def forward(self, b: ForwardBatch, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """→ (logits [L, vocab] fp32, final hidden [E, hidden] or None)."""
        cfg = self.cfg
        t = b.token_ids.shape[0]
        h = self.embed.rows(b.token_ids)  # [T, hidden]
        # the C kernels read fp32 K/V: a bf16 pool on CPU is read through an upcast copy of
        # the blocks this step's tables name
        pool = None if self.fused or kv.dtype == torch.float32 else kv.renumber(b.block_tables)
        if not self.fused:
            cos = self.cos[b.positions][:, None, :]  # [T, 1, D]
            sin = self.sin[b.positions][:, None, :]
        for i, layer in enumerate(self.layers):
            # [T, (H + 2*KVH) * D]: the attention's norm, then qkv
            qkv = ops.norm_linear(layer.qkv, h, layer.attn_norm, cfg.rms_norm_eps)
            if self.fused:  # one kernel: q [T, H, D] out, K/V into the pool
                q = ops.qkv_rope_store(qkv, b.positions, self.cos, self.sin, layer.q_norm,
                                       layer.k_norm, cfg.rms_norm_eps, b.slots, kv.k[i], kv.v[i],
                                       cfg.num_heads)
            else:
                q = qkv[:, : cfg.q_size].reshape(t, cfg.num_heads, cfg.head_dim)
                k = qkv[:, cfg.q_size: cfg.q_size + cfg.kv_size].reshape(t, cfg.num_kv_heads, cfg.head_dim)
                v = qkv[:, cfg.q_size + cfg.kv_size:].reshape(t, cfg.num_kv_heads, cfg.head_dim)
                if layer.q_norm is not None:
                    q = ops.rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
                    k = ops.rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
                q, k = _rope(q, cos, sin), _rope(k, cos, sin)
                kv.write(i, b.slots, k, v.contiguous())
            attn = self._attention(q, kv, i, b, pool)  # [T, H, D]
            h = ops.linear_residual(layer.o, attn.reshape(t, cfg.q_size), h)  # h + o(attn)
            if layer.moe is not None:  # CUDA: the norm, router, grouped experts, combine + residual
                h = ops.norm_moe(h, layer.mlp_norm, cfg.rms_norm_eps, layer.router, layer.moe,
                                 cfg.num_experts_per_tok, cfg.norm_topk_prob)
            else:
                x = ops.rms_norm(h, layer.mlp_norm, cfg.rms_norm_eps)
                h = self._moe(layer, x, h) if layer.router is not None else \
                    h + _mlp(layer.gate_up, layer.down, x)
        hidden = None
        if b.hidden_rows is not None and b.hidden_rows.numel():
            hidden = ops.rms_norm(h[b.hidden_rows], self.final_norm, cfg.rms_norm_eps)
        logits = None
        if b.logit_rows.numel():
            logits = ops.linear(self.lm_head, ops.rms_norm(h[b.logit_rows], self.final_norm, cfg.rms_norm_eps))
        return logits, hidden

    def _attention(self, q: torch.Tensor, kv: KVCache, i: int, b: ForwardBatch,
                   pool: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Each token over its own stream's keys [0, position]: paged kernel, or tiled prefill
        for the spans in b.prefill."""
        kc, vc, tables = kv.k[i], kv.v[i], b.block_tables
        if pool is not None:
            used, tables = pool
            kc, vc = kc[used].float(), vc[used].float()  # [U, BS, KVH, D], exact
        if not b.prefill:
            return ops.paged_attention(q, kc, vc, tables, b.tok_row, b.ctx_lens, self.scale)
        attn = torch.empty_like(q)
        if b.paged_rows.numel():
            rows = b.paged_rows
            attn[rows] = ops.paged_attention(q[rows].contiguous(), kc, vc, tables, b.paged_tok_row,
                                             b.paged_ctx_lens, self.scale)
        # packed across streams only where a row's bits do not depend on its company
        # (kernels/prefill.py: prefill_attention_batch)
        prefill.prefill_attention_batch(
            q, kv.k[i], kv.v[i], b.block_tables, [(sp.row, sp.n, sp.start, sp.table) for sp in b.prefill],
            self.scale, attn, max_keys=self.cfg.max_position + prefill.PIECE)
        return attn

    def _moe(self, layer: _Layer, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h + top-k experts per token through the per-expert Linears (experts not stacked);
        the k contributions are summed in rank order (fixed)."""
        cfg = self.cfg
        probs = ops.softmax(ops.linear(layer.router, x))  # [T, E]
        top_w, top_i = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)  # [T, k]
        if cfg.norm_topk_prob:
            total = top_w[:, 0]
            for j in range(1, top_w.shape[1]):
                total = total + top_w[:, j]
            top_w = top_w / total[:, None]
        ys = torch.zeros(top_w.shape[1], x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        for e in torch.unique(top_i).tolist():
            tok, rank = (top_i == e).nonzero(as_tuple=True)
            gate_up, down = layer.experts[e]
            ys[rank, tok] = _mlp(gate_up, down, x[tok])
        out = ys[0] * top_w[:, 0:1]
        for j in range(1, ys.shape[0]):
            out = out + ys[j] * top_w[:, j: j + 1]
        return h + out


def _mlp(gate_up: Linear, down: Linear, x: torch.Tensor) -> torch.Tensor:
    gu = ops.linear(gate_up, x)  # [T, 2I]
    inter = gu.shape[1] // 2
    return ops.linear(down, ops.silu_mul(gu[:, :inter], gu[:, inter:]))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; x [T, heads, D], cos/sin [T, 1, D]. Elementwise, hence row-local."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin
