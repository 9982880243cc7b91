"""Load a GGUF file (llama / qwen3 / qwen3moe) into a LoadedModel.

Weights stay in their storage format (kernels.linear.from_gguf). Two GGUF conventions are undone:
tensor shapes are listed innermost-first (t.shape is [in, out]; quantized t.data is
[out, bytes_per_row]), and llama.cpp's converter permutes q/k rows for interleaved RoPE — we put
them back in Hugging Face (rotate-half) order, which is exact on quantized rows because
quantization blocks run along the input dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from kernels.linear import Linear, from_gguf
from replica.errors import ModelFormatError
from replica.models.gguf_file import GGUFError, GGUFFile, read_gguf
from replica.models.spec import Expert, LayerWeights, LoadedModel, ModelConfig, ModelWeights
from replica.models.tokenizer import Tokenizer

GGUF_ARCHS = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}  # general.architecture → ours
LINEAR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
VECTOR_TYPES = ("F32", "F16", "BF16")


def load_gguf(path: str | Path) -> LoadedModel:
    """Read a GGUF file into config, weights and tokenizer; ModelFormatError for anything we can't use."""
    path = Path(path)
    reader = _open(path)
    meta = _Meta(reader.fields, path)
    arch = _arch(meta)
    try:
        tokenizer = Tokenizer.from_gguf(reader.fields)
    except ModelFormatError as e:
        raise ModelFormatError(f"{path}: {e.message}") from e
    except Exception as e:  # undecodable strings, merges naming unknown tokens (tokenizers' errors)
        raise ModelFormatError(f"{path}: cannot build the tokenizer from its metadata "
                               f"({type(e).__name__}: {e})") from e
    tensors = {t.name: t for t in reader.tensors}
    config = _config(meta, arch, tokenizer, tensors)
    weights = _Tensors(tensors, path, config).weights()
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer)


def _open(path: Path) -> GGUFFile:
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such GGUF file")
    try:
        reader = read_gguf(path)
    except (GGUFError, OSError) as e:  # a short, garbled or unreadable file
        raise ModelFormatError(f"{path}: not a valid GGUF file, truncated or corrupt "
                               f"({path.stat().st_size} bytes; {type(e).__name__}: {e})") from e
    for t in reader.tensors:  # tensors slice a memmap: a short file gives short tensors
        if t.data.nbytes != t.n_bytes:
            raise ModelFormatError(f"{path}: tensor {t.name} data is cut short "
                                   f"({t.data.nbytes} of {t.n_bytes} bytes): truncated file")
    return reader


@dataclass(frozen=True)
class _Meta:
    """Typed access to GGUF metadata; a missing or ill-typed key names the file and the key."""

    fields: Any
    path: Path

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def require(self, key: str, kind: type) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelFormatError(f"{self.path}: metadata {key} is missing")
        kinds = (int, float) if kind is float else (kind,)  # a float key may be written as an int
        if not isinstance(value, kinds) or isinstance(value, bool) != (kind is bool):
            raise ModelFormatError(f"{self.path}: metadata {key} should be {kind.__name__}, got {value!r}")
        return value


def _arch(meta: _Meta) -> str:
    """Our architecture name for general.architecture, or ModelFormatError."""
    gguf_arch = meta.require("general.architecture", str)
    if gguf_arch not in GGUF_ARCHS:
        raise ModelFormatError(f"{meta.path}: unsupported architecture {gguf_arch!r}; "
                               f"supported: {', '.join(GGUF_ARCHS)}")
    return GGUF_ARCHS[gguf_arch]


def _config(meta: _Meta, arch: str, tokenizer: Tokenizer, tensors: dict) -> ModelConfig:
    """ModelConfig from `{arch}.*` keys (llama.cpp names); shapes are checked again per tensor."""
    path = meta.path
    p = meta.get("general.architecture")  # the key prefix, e.g. "qwen3moe"
    hidden, heads = meta.require(f"{p}.embedding_length", int), meta.require(f"{p}.attention.head_count", int)
    kv_heads = meta.get(f"{p}.attention.head_count_kv", heads)
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ModelFormatError(f"{path}: tensor token_embd.weight is missing")
    scaling = meta.get(f"{p}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensors:  # llama-3.1 style long-context RoPE
        raise ModelFormatError(f"{path}: RoPE scaling ({scaling!r}, rope_freqs) is not supported")
    moe = arch == "qwen3_moe"
    try:
        return ModelConfig(
            name=path.name.removesuffix(".gguf"), arch=arch,
            vocab_size=meta.get(f"{p}.vocab_size", int(embd.shape[1])), hidden_size=hidden,
            intermediate_size=0 if moe else meta.require(f"{p}.feed_forward_length", int),
            num_layers=meta.require(f"{p}.block_count", int), num_heads=heads, num_kv_heads=kv_heads,
            head_dim=meta.get(f"{p}.attention.key_length", hidden // heads),
            rms_norm_eps=float(meta.require(f"{p}.attention.layer_norm_rms_epsilon", float)),
            rope_theta=float(meta.get(f"{p}.rope.freq_base", 10000.0)),
            max_position=meta.require(f"{p}.context_length", int),
            tie_word_embeddings="output.weight" not in tensors,
            bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids,
            qk_norm=arch != "llama",
            num_experts=meta.get(f"{p}.expert_count", 0) if moe else 0,
            num_experts_per_tok=meta.get(f"{p}.expert_used_count", 0) if moe else 0,
            moe_intermediate_size=meta.get(f"{p}.expert_feed_forward_length", 0) if moe else 0,
            norm_topk_prob=moe,  # llama.cpp always renormalizes qwen3moe's top-k weights
        )
    except (ValueError, ZeroDivisionError) as e:  # e.g. heads not a multiple of kv heads, or 0
        raise ModelFormatError(f"{path}: inconsistent model metadata: {e}") from e


@dataclass
class _Tensors:
    """Turns named GGUF tensors into Linear / fp32 vectors, checking each shape against the config."""

    tensors: dict
    path: Path
    config: ModelConfig
    bar: Any = None

    def weights(self) -> ModelWeights:
        c = self.config
        self.bar = tqdm(total=len(self.tensors), desc=f"loading {self.path.name}", unit="tensor",
                        disable=None, leave=False)
        with self.bar:
            embed = self.linear("token_embd.weight", c.vocab_size, c.hidden_size)
            layers = tuple(self.layer(i) for i in range(c.num_layers))
            final_norm = self.vector("output_norm.weight", c.hidden_size)
            lm_head = embed if c.tie_word_embeddings else \
                self.linear("output.weight", c.vocab_size, c.hidden_size)
        return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)

    def layer(self, i: int) -> LayerWeights:
        c, b = self.config, f"blk.{i}."
        q = self.linear(b + "attn_q.weight", c.q_size, c.hidden_size)
        k = self.linear(b + "attn_k.weight", c.kv_size, c.hidden_size)
        if c.arch == "llama":  # only the llama converter permutes (qwen3 uses NEOX RoPE as is)
            q, k = _unpermute(q, c.num_heads), _unpermute(k, c.num_kv_heads)
        parts: dict[str, Any] = dict(
            attn_norm=self.vector(b + "attn_norm.weight", c.hidden_size), q=q, k=k,
            v=self.linear(b + "attn_v.weight", c.kv_size, c.hidden_size),
            o=self.linear(b + "attn_output.weight", c.hidden_size, c.q_size),
            mlp_norm=self.vector(b + "ffn_norm.weight", c.hidden_size))
        if c.qk_norm:
            parts.update(q_norm=self.vector(b + "attn_q_norm.weight", c.head_dim),
                         k_norm=self.vector(b + "attn_k_norm.weight", c.head_dim))
        if c.is_moe:
            parts.update(router=self.linear(b + "ffn_gate_inp.weight", c.num_experts, c.hidden_size),
                         experts=self.experts(b))
        else:
            parts.update(gate=self.linear(b + "ffn_gate.weight", c.intermediate_size, c.hidden_size),
                         up=self.linear(b + "ffn_up.weight", c.intermediate_size, c.hidden_size),
                         down=self.linear(b + "ffn_down.weight", c.hidden_size, c.intermediate_size))
        return LayerWeights(**parts)

    def experts(self, b: str) -> tuple[Expert, ...]:
        c = self.config
        h, m = c.hidden_size, c.moe_intermediate_size
        gate = self.stacked(b + "ffn_gate_exps.weight", m, h)
        up = self.stacked(b + "ffn_up_exps.weight", m, h)
        down = self.stacked(b + "ffn_down_exps.weight", h, m)
        return tuple(Expert(gate=g, up=u, down=d) for g, u, d in zip(gate, up, down))

    # ---- one tensor -------------------------------------------------------------------------
    def find(self, name: str, shape: tuple[int, ...], types: tuple[str, ...]) -> Any:
        """The tensor `name`, checked: shape in GGUF order (innermost first) and type."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelFormatError(f"{self.path}: tensor {name} is missing")
        got = tuple(int(n) for n in t.shape)
        if got != shape:
            raise ModelFormatError(f"{self.path}: tensor {name} has shape {list(got)}, "
                                   f"expected {list(shape)} for this config")
        if t.tensor_type.name not in types:
            raise ModelFormatError(f"{self.path}: tensor {name} has unsupported type "
                                   f"{t.tensor_type.name}; supported: {', '.join(types)}")
        self.bar.update(1)
        return t

    def linear(self, name: str, out_features: int, in_features: int) -> Linear:
        t = self.find(name, (in_features, out_features), LINEAR_TYPES)
        return self.convert(name, t.tensor_type.name, t.data, out_features, in_features)

    def stacked(self, name: str, out_features: int, in_features: int) -> list[Linear]:
        """An expert-stacked tensor (GGUF [in, out, n_expert]; data [n_expert, out, row]) → per expert."""
        n = self.config.num_experts
        t = self.find(name, (in_features, out_features, n), LINEAR_TYPES)
        return [self.convert(name, t.tensor_type.name, t.data[e], out_features, in_features)
                for e in range(n)]

    def convert(self, name: str, type_name: str, raw: np.ndarray, out_f: int, in_f: int) -> Linear:
        try:
            return from_gguf(type_name, raw, out_f, in_f)
        except ValueError as e:  # a row size that does not match the type's block layout
            raise ModelFormatError(f"{self.path}: tensor {name} ({type_name}) is malformed: {e}") from e

    def vector(self, name: str, size: int) -> torch.Tensor:
        t = self.find(name, (size,), VECTOR_TYPES)
        if t.tensor_type.name == "BF16":
            u32 = np.ascontiguousarray(t.data).view(np.uint16).astype(np.uint32) << 16
            return torch.from_numpy(u32.view(np.float32).reshape(size))
        return torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(size))  # [size] (a copy)


def _unpermute(lin: Linear, n_head: int) -> Linear:
    """Undo convert_hf_to_gguf's permute(w, n_head): rows [h, d/2, 2] → Hugging Face [h, 2, d/2]."""
    rows = lin.out_features
    perm = torch.arange(rows).view(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(rows)
    pick = lambda t: None if t is None else t[perm].contiguous()  # noqa: E731
    return Linear(lin.fmt, lin.out_features, lin.in_features, weight=pick(lin.weight),
                  qs=pick(lin.qs), scale=pick(lin.scale), minv=pick(lin.minv))
