"""`synthetic:<preset>` models: random weights of a real (or tiny) shape.

For benchmarks and fast tests only: never a default, and ModelConfig.synthetic=True labels them
everywhere they appear. Weights are random normals scaled like a trained model's (std
1/sqrt(fan_in)), so activations stay finite, and stored in the preset's format (q4 or f32).
The tokenizer is a byte tokenizer: ids 0..255 are bytes, then a few special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.linear import Linear
from replica.errors import UnknownModelError
from replica.models.spec import Expert, LayerWeights, LoadedModel, ModelConfig, ModelWeights

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class Preset:
    arch: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_position: int
    fmt: str  # "q4" | "f32"
    tie: bool
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0


PRESETS = {
    "tiny-llama": Preset("llama", 320, 64, 128, 2, 4, 2, 16, 1024, "f32", True),
    "tiny-llama-q4": Preset("llama", 320, 64, 128, 2, 4, 2, 16, 1024, "q4", True),
    "tiny-qwen3-moe": Preset("qwen3_moe", 320, 64, 0, 2, 4, 2, 16, 1024, "f32", False, 8, 2, 32),
    # long contexts at small cost (GPU tests): the 30B preset's head_dim, GQA and q4 storage
    "small-qwen3-moe-q4": Preset("qwen3_moe", 2048, 256, 0, 4, 8, 2, 128, 40960, "q4", False,
                                 16, 4, 128),
    "qwen3-30b-a3b-int4": Preset("qwen3_moe", 151936, 2048, 0, 48, 32, 4, 128, 40960, "q4",
                                 False, 128, 8, 768),
}


class ByteTokenizer:
    """Bytes as tokens (0..255) plus SPECIALS; enough to drive synthetic models end to end."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.specials = {name: 256 + i for i, name in enumerate(SPECIALS)}
        self._names = {v: k for k, v in self.specials.items()}
        self.bos_token_id = None
        self.eos_token_ids = (self.specials["<|im_end|>"], self.specials["<|endoftext|>"])

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        rest = text
        while rest:
            hit = next((s for s in SPECIALS if rest.startswith(s)), None)
            if hit:
                out.append(self.specials[hit])
                rest = rest[len(hit):]
            else:
                out.extend(rest[0].encode("utf-8"))
                rest = rest[1:]
        return out

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytearray()
        parts: list[str] = []
        for i in ids:
            if i < 256:
                data.append(i)
                continue
            parts.append(data.decode("utf-8", errors="replace"))
            data = bytearray()
            name = self._names.get(i)
            if name is None:
                parts.append(f"<{i}>")
            elif not skip_special_tokens:
                parts.append(name)
        parts.append(data.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from replica.models.tokenizer import validate_messages

        validate_messages(messages)
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def synthetic_model(preset_name: str, seed: int = 0, device: str = "cpu") -> LoadedModel:
    """Build a preset with random weights (deterministic in seed and device).

    device="cuda" draws the weights on the GPU with its own generator (seconds for the 30B
    preset instead of minutes, and no host copy); the values then differ from the CPU draw.
    """
    if preset_name not in PRESETS:
        raise UnknownModelError(f"unknown synthetic preset {preset_name!r}; known: {sorted(PRESETS)}")
    p = PRESETS[preset_name]
    cfg = ModelConfig(
        name=f"synthetic:{preset_name}", arch=p.arch, vocab_size=p.vocab, hidden_size=p.hidden,
        intermediate_size=p.intermediate, num_layers=p.layers, num_heads=p.heads,
        num_kv_heads=p.kv_heads, head_dim=p.head_dim, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position=p.max_position, tie_word_embeddings=p.tie, bos_token_id=None,
        eos_token_ids=(258, 256), qk_norm=p.arch != "llama", num_experts=p.experts,
        num_experts_per_tok=p.top_k, moe_intermediate_size=p.moe_intermediate,
        norm_topk_prob=p.experts > 0, synthetic=True)
    g = torch.Generator(device=device).manual_seed(seed)
    dev = dict(generator=g, device=device)

    def lin(out: int, inp: int) -> Linear:
        if p.fmt == "f32":
            return Linear.dense(torch.randn(out, inp, **dev) * inp ** -0.5)
        # random nibbles directly (a 30B model never exists in float): q uniform in 0..15 has
        # std 4.6, so scale = 1/(4.6*sqrt(fan_in)) gives weights of std 1/sqrt(fan_in)
        qs = torch.randint(0, 256, (out, inp // 2), dtype=torch.uint8, **dev)
        scale = torch.full((out, inp // 32), 1.0 / (4.6 * inp ** 0.5), device=device)
        scale = scale * (1 + 0.25 * torch.rand(out, inp // 32, **dev))
        return Linear.q4(qs, scale, -7.5 * scale)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, **dev)

    layers = []
    for _ in range(p.layers):
        dense = p.experts == 0
        layers.append(LayerWeights(
            attn_norm=norm(p.hidden), q=lin(p.heads * p.head_dim, p.hidden),
            k=lin(p.kv_heads * p.head_dim, p.hidden), v=lin(p.kv_heads * p.head_dim, p.hidden),
            o=lin(p.hidden, p.heads * p.head_dim), mlp_norm=norm(p.hidden),
            q_norm=None if p.arch == "llama" else norm(p.head_dim),
            k_norm=None if p.arch == "llama" else norm(p.head_dim),
            gate=lin(p.intermediate, p.hidden) if dense else None,
            up=lin(p.intermediate, p.hidden) if dense else None,
            down=lin(p.hidden, p.intermediate) if dense else None,
            router=None if dense else lin(p.experts, p.hidden),
            experts=tuple(Expert(lin(p.moe_intermediate, p.hidden), lin(p.moe_intermediate, p.hidden),
                                 lin(p.hidden, p.moe_intermediate)) for _ in range(p.experts)),
        ))
    embed = lin(p.vocab, p.hidden)
    lm_head = embed if p.tie else lin(p.vocab, p.hidden)
    weights = ModelWeights(embed, tuple(layers), norm(p.hidden), lm_head)
    return LoadedModel(cfg, weights, ByteTokenizer(p.vocab))
