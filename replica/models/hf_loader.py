"""Load a Hugging Face model directory into a LoadedModel (llama, qwen3, qwen3_moe).

The directory holds config.json, optional generation_config.json, *.safetensors (sharded with
model.safetensors.index.json or not), tokenizer.json and tokenizer_config.json.
Float weights (fp32/bf16/fp16) become Linear.dense (fp32); norms fp32 vectors.
GPTQ int4 (quant_method "gptq", bits 4, sym, desc_act false, trivial g_idx) becomes q4 through
kernels.linear.from_gptq. Zero points: checkpoint_format "gptq" (the default, AutoGPTQ/optimum
"v1") stores zero-1, so zero_offset=1; "gptq_v2" (GPTQModel's internal format) stores the zero
itself, zero_offset=0. Anything else we cannot read exactly raises ModelFormatError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from kernels.linear import Linear, from_gptq
from replica.errors import ModelFormatError
from replica.models.spec import ARCHS, Expert, LayerWeights, LoadedModel, ModelConfig, ModelWeights

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format → what from_gptq adds to qzeros


def load_hf_dir(path: str | Path) -> LoadedModel:
    """Config, weights and tokenizer of a Hugging Face directory; ModelFormatError if unreadable."""
    config, weights = load_hf_weights(path)
    from replica.models.tokenizer import Tokenizer  # lazy: keeps weight loading tokenizer-free

    return LoadedModel(config, weights, Tokenizer.from_hf_dir(Path(path)))


def read_hf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig described by config.json (+ generation_config.json) in `path`."""
    return _Spec.read(Path(path)).config


def load_hf_weights(path: str | Path) -> tuple[ModelConfig, ModelWeights]:
    """ModelConfig and ModelWeights of a Hugging Face directory, without the tokenizer."""
    spec = _Spec.read(Path(path))
    cfg = spec.config
    tensors = _Tensors(Path(path))
    pre = "model." if tensors.has("model.embed_tokens.weight") else ""
    loader = _LayerLoader(spec, tensors)
    with tqdm(total=cfg.num_layers + 2, desc=f"loading {cfg.name}", unit="layer",
              disable=None) as bar:
        embed = loader.linear(f"{pre}embed_tokens", cfg.vocab_size, cfg.hidden_size)
        bar.update(1)
        layers = []
        for i in range(cfg.num_layers):
            layers.append(loader.layer(f"{pre}layers.{i}", i in spec.sparse_layers))
            bar.update(1)
        final_norm = loader.norm(f"{pre}norm.weight", cfg.hidden_size)
        lm_head = embed if cfg.tie_word_embeddings else loader.linear(
            "lm_head", cfg.vocab_size, cfg.hidden_size)
        bar.update(1)
    return cfg, ModelWeights(embed, tuple(layers), final_norm, lm_head)


# ---- config ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Spec:
    """What config.json says: the ModelConfig plus what it cannot hold (MoE layers, GPTQ)."""

    config: ModelConfig
    sparse_layers: frozenset[int]  # layers with an MoE block instead of a dense MLP
    gptq_group: int  # 0: not quantized
    gptq_zero_offset: int

    @classmethod
    def read(cls, path: Path) -> "_Spec":
        raw = _read_json(path / "config.json", required=True)
        gen = _read_json(path / "generation_config.json", required=False)
        arch = raw.get("model_type")
        if arch not in ARCHS:
            raise ModelFormatError(f"{path / 'config.json'}: model_type {arch!r} is not one of {ARCHS}")
        _refuse_unsupported(raw, path)
        group, zero_offset = _gptq(raw.get("quantization_config"), path)
        n = _req(raw, "num_hidden_layers", path)
        heads = _req(raw, "num_attention_heads", path)
        hidden = _req(raw, "hidden_size", path)
        num_experts = int(raw.get("num_experts", raw.get("num_local_experts", 0)) or 0)
        sparse = frozenset(_sparse_layers(raw, n, num_experts) if arch == "qwen3_moe" else ())
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        eos = [e for src in (gen, raw) for e in _ids(src.get("eos_token_id"))]
        bos = next((src["bos_token_id"] for src in (gen, raw) if src.get("bos_token_id") is not None),
                   None)
        try:
            config = ModelConfig(
                name=path.resolve().name, arch=arch, vocab_size=_req(raw, "vocab_size", path),
                hidden_size=hidden,
                intermediate_size=(_req(raw, "intermediate_size", path)
                                   if len(sparse) < n else 0),
                num_layers=n, num_heads=heads,
                num_kv_heads=raw.get("num_key_value_heads") or heads,
                head_dim=raw.get("head_dim") or hidden // heads,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                max_position=_req(raw, "max_position_embeddings", path),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                bos_token_id=bos, eos_token_ids=tuple(dict.fromkeys(eos)),
                qk_norm=arch in ("qwen3", "qwen3_moe"),
                num_experts=num_experts if sparse else 0,
                num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)) if sparse else 0,
                moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)) if sparse else 0,
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)))
        except (ValueError, TypeError) as e:
            raise ModelFormatError(f"{path / 'config.json'}: {e}") from e
        return cls(config, sparse, group, zero_offset)


def _refuse_unsupported(raw: dict, path: Path) -> None:
    """Features config.json may switch on that our forward pass does not implement."""
    where = path / "config.json"
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelFormatError(f"{where}: hidden_act {raw['hidden_act']!r} (only silu)")
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if raw.get(key):
            raise ModelFormatError(f"{where}: {key}=true is not supported")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ModelFormatError(f"{where}: rope scaling {kind!r} is not supported")


def _sparse_layers(raw: dict, n: int, num_experts: int) -> list[int]:
    """transformers' rule: MoE iff not in mlp_only_layers and (i+1) % decoder_sparse_step == 0."""
    if num_experts <= 0:
        raise ModelFormatError("qwen3_moe config.json has no num_experts / num_local_experts")
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def _gptq(qc: dict | None, path: Path) -> tuple[int, int]:
    """(group size, zero offset) of a GPTQ quantization_config; (0, 0) when not quantized."""
    if not qc:
        return 0, 0
    where = f"{path / 'config.json'} quantization_config"
    checks = [(qc.get("quant_method") == "gptq", f"quant_method {qc.get('quant_method')!r}"),
              (qc.get("bits") == 4, f"bits {qc.get('bits')!r} (only 4)"),
              (qc.get("sym", True), "sym=false (asymmetric)"),
              (not qc.get("desc_act", False), "desc_act=true (act-order)"),
              (not qc.get("dynamic"), "per-module 'dynamic' overrides")]
    for ok, what in checks:
        if not ok:
            raise ModelFormatError(f"{where}: {what} is not supported")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    group = qc.get("group_size", 128)
    if fmt not in _ZERO_OFFSET:
        raise ModelFormatError(f"{where}: checkpoint_format {fmt!r} is not one of {list(_ZERO_OFFSET)}")
    if not isinstance(group, int) or group <= 0 or group % 32:
        raise ModelFormatError(f"{where}: group_size {group!r} must be a positive multiple of 32")
    return group, _ZERO_OFFSET[fmt]


def _read_json(file: Path, required: bool) -> dict:
    if not file.exists():
        if required:
            raise ModelFormatError(f"{file} not found")
        return {}
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{file}: unreadable JSON ({e})") from e


def _req(raw: dict, key: str, path: Path):
    if raw.get(key) is None:
        raise ModelFormatError(f"{path / 'config.json'}: missing {key!r}")
    return raw[key]


def _ids(v) -> list[int]:
    return [] if v is None else [int(x) for x in (v if isinstance(v, list) else [v])]


# ---- tensors --------------------------------------------------------------------------------
class _Tensors:
    """Name → tensor over the directory's safetensors files (sharded or not)."""

    def __init__(self, path: Path) -> None:
        self._handles: dict[Path, object] = {}  # shard path → open safe_open handle
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = _read_json(index, required=True).get("weight_map") or {}
            files = {name: path / f for name, f in weight_map.items()}
        else:
            shards = sorted(path.glob("*.safetensors"))
            if not shards:
                raise ModelFormatError(f"{path}: no *.safetensors files")
            files = {}
            for shard in shards:
                for name in self._open(shard).keys():
                    if name in files:
                        raise ModelFormatError(f"{name} is in both {files[name]} and {shard}")
                    files[name] = shard
        self._files = files  # tensor name → shard path

    def _open(self, file: Path):
        if file not in self._handles:
            if not file.exists():
                raise ModelFormatError(f"{file} (named by the safetensors index) not found")
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as e:
                raise ModelFormatError(f"{file}: corrupt or truncated safetensors ({e})") from e
        return self._handles[file]

    def has(self, name: str) -> bool:
        return name in self._files

    def shape(self, name: str) -> tuple[int, ...]:
        """Stored shape of `name` without reading its data."""
        if name not in self._files:
            raise ModelFormatError(f"missing tensor {name!r}")
        return tuple(self._open(self._files[name]).get_slice(name).get_shape())

    def get(self, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
        """The tensor `name`, checked against shape and dtypes."""
        if name not in self._files:
            raise ModelFormatError(f"missing tensor {name!r}")
        file = self._files[name]
        try:
            t = self._open(file).get_tensor(name)
        except SafetensorError as e:
            raise ModelFormatError(f"{file}: cannot read tensor {name!r} ({e})") from e
        if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes:
            raise ModelFormatError(f"{file}: tensor {name!r} is {tuple(t.shape)} {t.dtype}, "
                                   f"expected {tuple(shape)} in {[str(d) for d in dtypes]}")
        return t


class _LayerLoader:
    """Builds Linear/norm/LayerWeights from tensor names, dense or GPTQ as the files hold them."""

    def __init__(self, spec: _Spec, tensors: _Tensors) -> None:
        self.spec, self.t, self.cfg = spec, tensors, spec.config

    def norm(self, name: str, size: int) -> torch.Tensor:
        return self.t.get(name, (size,), _FLOATS).to(torch.float32).contiguous()  # [size]

    def linear(self, prefix: str, out_f: int, in_f: int) -> Linear:
        """`prefix`.weight [out, in] (float) or `prefix`.qweight/qzeros/scales[/g_idx] (GPTQ)."""
        if self.t.has(f"{prefix}.weight") or not self.t.has(f"{prefix}.qweight"):
            return Linear.dense(self.t.get(f"{prefix}.weight", (out_f, in_f), _FLOATS))
        group = self.spec.gptq_group
        if not group:
            raise ModelFormatError(f"{prefix}.qweight found but config.json has no GPTQ "
                                   "quantization_config")
        if in_f % group or out_f % 8:
            raise ModelFormatError(f"{prefix}: GPTQ needs in ({in_f}) % {group} == 0, out % 8 == 0")
        qweight = self.t.get(f"{prefix}.qweight", (in_f // 8, out_f), (torch.int32,))
        qzeros = self.t.get(f"{prefix}.qzeros", (in_f // group, out_f // 8), (torch.int32,))
        scales = self.t.get(f"{prefix}.scales", (in_f // group, out_f), _FLOATS)
        if self.t.has(f"{prefix}.g_idx"):
            g_idx = self.t.get(f"{prefix}.g_idx", (in_f,), (torch.int32, torch.int64))
            if not torch.equal(g_idx.long(), torch.arange(in_f) // group):
                raise ModelFormatError(f"{prefix}.g_idx is not i // {group}: act-order GPTQ "
                                       "is not supported")
        try:
            return from_gptq(qweight, qzeros, scales, group, self.spec.gptq_zero_offset)
        except ValueError as e:
            raise ModelFormatError(f"{prefix}: {e}") from e

    def layer(self, p: str, sparse: bool) -> LayerWeights:
        """Decoder layer `p` (e.g. "model.layers.3"); MoE block when `sparse`."""
        c, h = self.cfg, self.cfg.hidden_size
        attn = dict(
            attn_norm=self.norm(f"{p}.input_layernorm.weight", h),
            q=self.linear(f"{p}.self_attn.q_proj", c.q_size, h),
            k=self.linear(f"{p}.self_attn.k_proj", c.kv_size, h),
            v=self.linear(f"{p}.self_attn.v_proj", c.kv_size, h),
            o=self.linear(f"{p}.self_attn.o_proj", h, c.q_size),
            mlp_norm=self.norm(f"{p}.post_attention_layernorm.weight", h))
        if c.qk_norm:
            attn["q_norm"] = self.norm(f"{p}.self_attn.q_norm.weight", c.head_dim)
            attn["k_norm"] = self.norm(f"{p}.self_attn.k_norm.weight", c.head_dim)
        if not sparse:
            i = c.intermediate_size
            return LayerWeights(**attn, gate=self.linear(f"{p}.mlp.gate_proj", i, h),
                                up=self.linear(f"{p}.mlp.up_proj", i, h),
                                down=self.linear(f"{p}.mlp.down_proj", h, i))
        router = self.linear(f"{p}.mlp.gate", c.num_experts, h)
        return LayerWeights(**attn, router=router, experts=self.experts(f"{p}.mlp.experts"))

    def experts(self, p: str) -> tuple[Expert, ...]:
        """Per-expert `p.{e}.{gate,up,down}_proj` or the fused `p.gate_up_proj`/`p.down_proj`."""
        c = self.cfg
        e_n, i, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
        if not self.t.has(f"{p}.gate_up_proj"):
            return tuple(Expert(self.linear(f"{p}.{e}.gate_proj", i, h),
                                self.linear(f"{p}.{e}.up_proj", i, h),
                                self.linear(f"{p}.{e}.down_proj", h, i)) for e in range(e_n))
        gate_up = self._fused(f"{p}.gate_up_proj", e_n, 2 * i, h)  # [E, 2I, H]: gate rows, up rows
        down = self._fused(f"{p}.down_proj", e_n, h, i)  # [E, H, I]
        return tuple(Expert(Linear.dense(gate_up[e, :i]), Linear.dense(gate_up[e, i:]),
                            Linear.dense(down[e])) for e in range(e_n))

    def _fused(self, name: str, e_n: int, out_f: int, in_f: int) -> torch.Tensor:
        """Fused expert weights as [E, out, in]; a stored [E, in, out] is transposed back.

        When out == in the two layouts cannot be told apart; transformers' own [E, out, in] wins.
        """
        if in_f != out_f and self.t.shape(name) == (e_n, in_f, out_f):
            return self.t.get(name, (e_n, in_f, out_f), _FLOATS).transpose(1, 2)
        return self.t.get(name, (e_n, out_f, in_f), _FLOATS)
