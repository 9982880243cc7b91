"""Tiny random Hugging Face models on disk, for loader and parity tests (not a test module).

Every builder writes a complete HF directory (config.json, generation_config.json, safetensors,
tokenizer.json, tokenizer_config.json) and returns a TinyModel holding the transformers model
whose weights the directory holds. Deterministic by seed; no network; each well under a second.
Hidden/intermediate sizes are multiples of 32 (our quantization block), head_dim of 8.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "2 + 2 = 4, and 3 * 7 = 21; 10 - 3 = 7.",
    "A tiny model for tests: it knows nothing, but its shapes are real.",
    "You are a helpful assistant. The user asks a question and the assistant answers.",
    "system user assistant tool function call result",
)
GPTQ_GROUP = 128


@dataclass(frozen=True, eq=False)
class TinyModel:
    """A model directory and the transformers model it was written from."""

    path: Path
    model: torch.nn.Module  # its parameters are exactly what the files hold (GPTQ: dequantized)
    # GPTQ only: HF tensor name → float64 weight [out, in] as the checkpoint encodes it
    reference: dict[str, torch.Tensor] = field(default_factory=dict)


def build_tokenizer():
    """A byte-level BPE `tokenizers.Tokenizer` (~380 tokens) trained in-process on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=384, min_frequency=1, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(_CORPUS) * 3, trainer)
    return tok


def save_tokenizer(tok, path: Path) -> None:
    """tokenizer.json + tokenizer_config.json (ChatML template, eos <|im_end|>)."""
    tok.save(str(path / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False,
                                      "rstrip": False, "normalized": False, "single_word": False}
             for t in SPECIAL_TOKENS}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
           "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
           "add_bos_token": False, "model_max_length": 512, "chat_template": CHATML_TEMPLATE,
           "added_tokens_decoder": added}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def _common(tok, **overrides) -> dict:
    """Shape fields shared by every tiny model (overridable)."""
    eos = tok.token_to_id("<|im_end|>")
    base = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                bos_token_id=None, eos_token_id=eos, pad_token_id=tok.token_to_id("<|endoftext|>"))
    return base | overrides


def _build(cls_name: str, cfg_name: str, seed: int, fields: dict) -> torch.nn.Module:
    import transformers

    config = getattr(transformers, cfg_name)(**fields)
    with torch.random.fork_rng(devices=[]):  # deterministic without touching the caller's RNG
        torch.manual_seed(seed)
        model = getattr(transformers, cls_name)(config)
        # transformers initializes norms to ones: randomize them so a swapped norm fails tests
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.data.uniform_(0.5, 1.5)
    return model.eval()


def _save(model: torch.nn.Module, tok, path: Path, dtype: torch.dtype,
          max_shard_size: str | None) -> TinyModel:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = model.to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    save_tokenizer(tok, path)
    return TinyModel(path, model)


def make_tiny_llama(path, seed: int = 0, dtype: torch.dtype = torch.float32,
                    max_shard_size: str | None = None, **config_overrides) -> TinyModel:
    """Llama, 2 layers, hidden 64, 4 q / 2 kv heads of 16, tied embeddings, bos <|endoftext|>."""
    tok = build_tokenizer()
    fields = _common(tok, tie_word_embeddings=True, bos_token_id=tok.token_to_id("<|endoftext|>"),
                     **config_overrides)
    return _save(_build("LlamaForCausalLM", "LlamaConfig", seed, fields), tok, path, dtype,
                 max_shard_size)


def make_tiny_qwen3(path, seed: int = 0, dtype: torch.dtype = torch.float32,
                    max_shard_size: str | None = None, **config_overrides) -> TinyModel:
    """Qwen3 (q/k norm), 3 layers, hidden 64, untied lm_head, eos [<|im_end|>, <|endoftext|>]."""
    tok = build_tokenizer()
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    fields = _common(tok, num_hidden_layers=3, tie_word_embeddings=False, eos_token_id=eos,
                     rope_theta=1000000.0)
    fields.update(config_overrides)
    return _save(_build("Qwen3ForCausalLM", "Qwen3Config", seed, fields), tok, path, dtype,
                 max_shard_size)


def make_tiny_qwen3_moe(path, seed: int = 0, dtype: torch.dtype = torch.float32,
                        fused: bool = False, **config_overrides) -> TinyModel:
    """Qwen3-MoE, 3 layers (layer 2 dense: mlp_only_layers=[2]), 8 experts top-2 of width 32.

    fused=True writes transformers' in-memory layout (mlp.experts.gate_up_proj [E, 2I, H],
    mlp.experts.down_proj [E, H, I]) instead of the per-expert names save_pretrained writes.
    config_overrides go to Qwen3MoeConfig (e.g. decoder_sparse_step, moe_intermediate_size).
    """
    tok = build_tokenizer()
    fields = _common(tok, num_hidden_layers=3, tie_word_embeddings=False, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[2])
    fields.update(config_overrides)
    model = _build("Qwen3MoeForCausalLM", "Qwen3MoeConfig", seed, fields)
    if not fused:
        return _save(model, tok, path, dtype, None)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = model.to(dtype)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    save_tokenizer(tok, path)
    return TinyModel(path, model)


# ---- GPTQ ----------------------------------------------------------------------------------
def gptq_quantize(w: torch.Tensor, group: int = GPTQ_GROUP, checkpoint_format: str = "gptq"
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Round w [out, in] to GPTQ int4 sym (no act-order) in GPTQ's packing.

    Returns ({qweight, qzeros, scales, g_idx}, float64 dequantized [out, in]).
    qweight [in//8, out] int32: bits 4k..4k+3 of row r hold input 8r+k; qzeros [in//group, out//8]
    int32 packs along out and stores zero-1 (= 7 for sym) in the classic "gptq" format, the
    zero itself (8) in "gptq_v2"; scales [in//group, out] fp16.
    """
    out_f, in_f = w.shape
    wt = w.detach().to(torch.float64).T  # [in, out]
    amax = wt.reshape(in_f // group, group, out_f).abs().amax(1)  # [G, out]
    scales = (2 * amax / 15).clamp_min(1e-6).to(torch.float16)  # [G, out]
    g_idx = torch.arange(in_f, dtype=torch.int32) // group  # [in]
    s = scales.to(torch.float64)[g_idx.long()]  # [in, out]
    q = (torch.round(wt / s) + 8).clamp(0, 15).to(torch.int64)  # [in, out], zero = 8
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    qweight = (q.view(in_f // 8, 8, out_f) << shifts[None, :, None]).sum(1)  # [in//8, out]
    stored = {"gptq": 8 - 1, "gptq_v2": 8}[checkpoint_format]
    zeros = torch.full((in_f // group, out_f // 8, 8), stored, dtype=torch.int64)
    qzeros = (zeros << shifts[None, None, :]).sum(-1)  # [G, out//8]
    tensors = {"qweight": _as_int32(qweight), "qzeros": _as_int32(qzeros), "scales": scales,
               "g_idx": g_idx}
    return tensors, ((q - 8).to(torch.float64) * s).T.contiguous()


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """Reinterpret uint32 values held in int64 as int32 (two's complement)."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def make_tiny_gptq_llama(path, seed: int = 0, checkpoint_format: str = "gptq") -> TinyModel:
    """Llama GPTQ int4 (sym, group 128, desc_act false): hidden 256, intermediate 512, 2 layers.

    Projections are written as qweight/qzeros/scales/g_idx, the rest as fp16. The returned model's
    parameters equal the checkpoint exactly (projections dequantized, others fp16-rounded), and
    `reference` maps each projection's `<prefix>.weight` name to its float64 dequantized weight.
    checkpoint_format "gptq_v2" stores the true zero point (8) instead of zero-1.
    """
    tok = build_tokenizer()
    fields = _common(tok, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=32, tie_word_embeddings=False)
    model = _build("LlamaForCausalLM", "LlamaConfig", seed, fields)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state, reference = {}, {}
    for name, p in model.state_dict().items():
        proj = name.endswith("_proj.weight")
        if not proj:
            p.copy_(p.half().float())  # in place: the model keeps what the file holds
            state[name] = p.half().contiguous()
            continue
        tensors, deq = gptq_quantize(p, GPTQ_GROUP, checkpoint_format)
        prefix = name[: -len(".weight")]
        state.update({f"{prefix}.{k}": v for k, v in tensors.items()})
        reference[name] = deq
        p.copy_(deq.to(torch.float32))  # exact: fp16 scale × small int fits fp32
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(model.config.to_json_string())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GPTQ_GROUP,
                                     "sym": True, "desc_act": False, "damp_percent": 0.01,
                                     "true_sequential": True, "static_groups": False,
                                     "checkpoint_format": checkpoint_format}
    config["dtype"] = "float16"
    (path / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(path)
    save_tokenizer(tok, path)
    return TinyModel(path, model, reference)
