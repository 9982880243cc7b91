"""What a loaded model is: its shape (ModelConfig) and its weights (ModelWeights).

Loaders (GGUF, Hugging Face directories, synthetic) produce these; the forward pass in
replica/models/transformer.py consumes them and knows nothing of file formats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.linear import Linear

ARCHS = ("llama", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer (llama / qwen3 / qwen3_moe)."""

    name: str
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (0 for pure-MoE models)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int  # context length
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k before RoPE
    num_experts: int = 0  # qwen3_moe
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    synthetic: bool = False  # random weights of a real shape: never a default, always labeled

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r}; supported: {ARCHS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.arch == "qwen3_moe" and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError("qwen3_moe needs 0 < num_experts_per_tok <= num_experts")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True, eq=False)
class Expert:
    gate: Linear  # [moe_intermediate, hidden]
    up: Linear  # [moe_intermediate, hidden]
    down: Linear  # [hidden, moe_intermediate]


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One decoder layer. Projections are Linear in storage form; norms are fp32 vectors.

    q/k rows are in Hugging Face order (rotate-half RoPE): a GGUF loader un-permutes them.
    """

    attn_norm: torch.Tensor  # [hidden]
    q: Linear  # [num_heads*head_dim, hidden]
    k: Linear  # [num_kv_heads*head_dim, hidden]
    v: Linear  # [num_kv_heads*head_dim, hidden]
    o: Linear  # [hidden, num_heads*head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    q_norm: torch.Tensor | None = None  # [head_dim] (qwen3)
    k_norm: torch.Tensor | None = None  # [head_dim] (qwen3)
    gate: Linear | None = None  # dense MLP [intermediate, hidden]
    up: Linear | None = None
    down: Linear | None = None  # [hidden, intermediate]
    router: Linear | None = None  # MoE [num_experts, hidden]
    experts: tuple[Expert, ...] = field(default_factory=tuple)


@dataclass(frozen=True, eq=False)
class ModelWeights:
    embed: Linear  # [vocab, hidden]; rows() is the token lookup
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [hidden]
    lm_head: Linear  # [vocab, hidden]; the same object as embed when tied

    @property
    def nbytes(self) -> int:
        """Bytes of weight storage (tied tables counted once)."""
        seen: set[int] = set()
        total = 0

        def add(obj) -> None:
            nonlocal total
            if obj is None or id(obj) in seen:
                return
            seen.add(id(obj))
            total += obj.nbytes if isinstance(obj, Linear) else obj.numel() * obj.element_size()

        add(self.embed), add(self.lm_head), add(self.final_norm)
        for layer in self.layers:
            for name in ("attn_norm", "q", "k", "v", "o", "mlp_norm", "q_norm", "k_norm",
                         "gate", "up", "down", "router"):
                add(getattr(layer, name))
            for e in layer.experts:
                add(e.gate), add(e.up), add(e.down)
        return total


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """Everything a loader returns: shape, weights, tokenizer (replica.models.tokenizer)."""

    config: ModelConfig
    weights: ModelWeights
    tokenizer: "object"
