"""The Hugging Face loader returns exactly the weights transformers holds, and refuses what it can't read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from replica.errors import ModelFormatError
from replica.models.hf_loader import load_hf_dir, load_hf_weights, read_hf_config
from tests.replica.tiny_models import (make_tiny_gptq_llama, make_tiny_llama, make_tiny_qwen3,
                                       make_tiny_qwen3_moe)


# ---- helpers --------------------------------------------------------------------------------
def ours_by_hf_name(weights) -> dict[str, torch.Tensor]:
    """Our loaded weights under transformers' in-memory state_dict names (experts fused)."""
    out = {"model.embed_tokens.weight": weights.embed.dequantize(),
           "model.norm.weight": weights.final_norm, "lm_head.weight": weights.lm_head.dequantize()}
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = layer.attn_norm
        out[f"{p}.post_attention_layernorm.weight"] = layer.mlp_norm
        for x in "qkvo":
            out[f"{p}.self_attn.{x}_proj.weight"] = getattr(layer, x).dequantize()
        if layer.q_norm is not None:
            out[f"{p}.self_attn.q_norm.weight"] = layer.q_norm
            out[f"{p}.self_attn.k_norm.weight"] = layer.k_norm
        if layer.router is None:
            for x in ("gate", "up", "down"):
                out[f"{p}.mlp.{x}_proj.weight"] = getattr(layer, x).dequantize()
        else:
            out[f"{p}.mlp.gate.weight"] = layer.router.dequantize()
            out[f"{p}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([e.gate.dequantize(), e.up.dequantize()]) for e in layer.experts])
            out[f"{p}.mlp.experts.down_proj"] = torch.stack([e.down.dequantize() for e in layer.experts])
    return out


def assert_same_as_transformers(weights, model) -> None:
    """Every tensor equal (after upcast to fp32) and fp32 in storage; same set of names."""
    ours, theirs = ours_by_hf_name(weights), model.state_dict()
    assert ours.keys() == theirs.keys()
    for name, ref in theirs.items():
        assert ours[name].dtype == torch.float32, name
        assert torch.equal(ours[name], ref.to(torch.float32)), name


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        elif isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k].update(v)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, fn) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    fn(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("moe"))


@pytest.fixture()
def gptq(tmp_path):
    return make_tiny_gptq_llama(tmp_path / "gptq")


# ---- dense models ---------------------------------------------------------------------------
def test_llama_weights_equal_transformers_and_lm_head_is_tied(llama):
    cfg, w = load_hf_weights(llama.path)
    assert_same_as_transformers(w, llama.model)
    assert w.lm_head is w.embed
    assert all(layer.q_norm is None and layer.router is None for layer in w.layers)


def test_llama_config_fields(llama):
    cfg = read_hf_config(llama.path)
    assert (cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == ("llama", 384, 64, 128)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.max_position) == (1e-6, 10000.0, 512)
    assert cfg.tie_word_embeddings and not cfg.qk_norm and not cfg.is_moe
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (0, (2,))
    assert cfg.name == llama.path.name


def test_qwen3_weights_equal_transformers_with_qk_norm_and_untied_head(qwen3):
    cfg, w = load_hf_weights(qwen3.path)
    assert_same_as_transformers(w, qwen3.model)
    assert w.lm_head is not w.embed
    assert w.layers[1].q_norm.shape == (16,) and not torch.equal(w.layers[1].q_norm, w.layers[1].k_norm)


def test_qwen3_config_fields(qwen3):
    cfg = read_hf_config(qwen3.path)
    assert (cfg.arch, cfg.num_layers, cfg.head_dim, cfg.rope_theta) == ("qwen3", 3, 16, 1e6)
    assert cfg.qk_norm and not cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (None, (2, 0))


def test_explicit_head_dim_wins_over_hidden_over_heads(tmp_path):
    # like real Qwen3 (hidden 1024, 16 heads of 128): here 8 heads of 16 over hidden 64
    tm = make_tiny_qwen3(tmp_path / "q", num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    cfg, w = load_hf_weights(tm.path)
    assert (cfg.head_dim, cfg.q_size, w.layers[0].o.in_features) == (16, 128, 128)
    assert_same_as_transformers(w, tm.model)
    edit_config(tm.path, head_dim=None)  # without it: hidden // heads
    assert read_hf_config(tm.path).head_dim == 8


def test_legacy_rope_theta_and_eos_union_with_generation_config(qwen3, tmp_path):
    path = tmp_path / "legacy"
    make_tiny_qwen3(path)
    edit_config(path, rope_parameters=None, rope_theta=500000.0, eos_token_id=5)
    cfg = read_hf_config(path)
    assert cfg.rope_theta == 500000.0
    assert cfg.eos_token_ids == (2, 0, 5)  # generation_config first, then config.json


def test_bf16_checkpoint_upcasts_exactly(tmp_path):
    tm = make_tiny_qwen3(tmp_path, dtype=torch.bfloat16)
    st = load_file(str(tm.path / "model.safetensors"))
    assert st["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    cfg, w = load_hf_weights(tm.path)
    assert_same_as_transformers(w, tm.model)


def test_sharded_checkpoint_with_index(tmp_path):
    tm = make_tiny_llama(tmp_path, max_shard_size="100KB")
    assert (tm.path / "model.safetensors.index.json").exists()
    assert len(list(tm.path.glob("*.safetensors"))) > 1
    cfg, w = load_hf_weights(tm.path)
    assert_same_as_transformers(w, tm.model)


def test_builders_are_deterministic_by_seed(tmp_path):
    a, b, c = (make_tiny_qwen3(tmp_path / n, seed=s) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    read = lambda tm: (tm.path / "model.safetensors").read_bytes()  # noqa: E731
    assert read(a) == read(b) and read(a) != read(c)
    assert (a.path / "tokenizer.json").read_text() == (b.path / "tokenizer.json").read_text()


# ---- MoE ------------------------------------------------------------------------------------
def test_moe_saved_per_expert_by_transformers(moe):
    names = load_file(str(moe.path / "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
def test_moe_weights_router_and_expert_3(tmp_path, fused):
    tm = make_tiny_qwen3_moe(tmp_path, fused=fused)
    cfg, w = load_hf_weights(tm.path)
    assert_same_as_transformers(w, tm.model)
    mlp = tm.model.model.layers[1].mlp
    e3 = w.layers[1].experts[3]
    i = cfg.moe_intermediate_size
    assert torch.equal(e3.gate.dequantize(), mlp.experts.gate_up_proj[3, :i].detach())
    assert torch.equal(e3.up.dequantize(), mlp.experts.gate_up_proj[3, i:].detach())
    assert torch.equal(e3.down.dequantize(), mlp.experts.down_proj[3].detach())
    assert torch.equal(w.layers[1].router.dequantize(), mlp.gate.weight.detach())
    assert (e3.gate.out_features, e3.gate.in_features, e3.down.out_features) == (32, 64, 64)
    assert len(w.layers[1].experts) == 8 and w.layers[1].gate is None
    assert w.layers[2].router is None and w.layers[2].gate.out_features == 128  # mlp_only_layers


def test_moe_fused_transposed_layout(tmp_path):
    # I=96, H=64: gate_up [E, 192, 64] vs [E, 64, 192], down [E, 64, 96] vs [E, 96, 64] differ
    tm = make_tiny_qwen3_moe(tmp_path, fused=True, moe_intermediate_size=96)
    edit_tensors(tm.path, lambda t: t.update({k: v.transpose(1, 2).contiguous()
                                              for k, v in t.items() if ".experts." in k}))
    cfg, w = load_hf_weights(tm.path)
    assert_same_as_transformers(w, tm.model)


def test_moe_config_fields(moe):
    cfg = read_hf_config(moe.path)
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert (cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.intermediate_size) == (32, True, 128)
    assert cfg.qk_norm and cfg.is_moe


def test_moe_num_experts_under_either_name(moe, tmp_path):
    cfg = json.loads((moe.path / "config.json").read_text())
    assert cfg["num_local_experts"] == 8  # what transformers 5 writes
    path = tmp_path / "m"
    make_tiny_qwen3_moe(path)
    edit_config(path, num_local_experts=None, num_experts=8)  # what Qwen's own configs say
    assert read_hf_config(path).num_experts == 8


def test_moe_decoder_sparse_step_matches_transformers(tmp_path):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    tm = make_tiny_qwen3_moe(tmp_path, decoder_sparse_step=2, mlp_only_layers=[])
    sparse_hf = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in tm.model.model.layers]
    cfg, w = load_hf_weights(tm.path)
    assert [layer.router is not None for layer in w.layers] == sparse_hf == [False, True, False]
    assert_same_as_transformers(w, tm.model)


def test_pure_moe_model_has_zero_dense_width(tmp_path):
    tm = make_tiny_qwen3_moe(tmp_path, mlp_only_layers=[])
    cfg, w = load_hf_weights(tm.path)
    assert cfg.intermediate_size == 0 and all(layer.router is not None for layer in w.layers)


# ---- GPTQ -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_dequantizes_to_reference(tmp_path, fmt):
    tm = make_tiny_gptq_llama(tmp_path, checkpoint_format=fmt)
    cfg, w = load_hf_weights(tm.path)
    ours = ours_by_hf_name(w)
    assert len(tm.reference) == 2 * 7
    for name, ref in tm.reference.items():
        got = ours[name].to(torch.float64)
        assert torch.allclose(got, ref, rtol=1e-6, atol=0), name
    assert w.layers[0].q.fmt == "q4" and w.layers[1].down.fmt == "q4"
    assert w.embed.fmt == "f32" and w.lm_head is not w.embed
    assert_same_as_transformers(w, tm.model)  # the model holds the dequantized weights


def test_gptq_packing_convention_by_hand(gptq):
    """qweight[r, j] nibble k is input 8r+k of output j; qzeros[g, j//8] nibble j%8 is zero-1."""
    st = load_file(str(gptq.path / "model.safetensors"))
    cfg, w = load_hf_weights(gptq.path)
    deq = w.layers[1].down.dequantize()  # [256, 512]: in 512 = 4 groups
    p = "model.layers.1.mlp.down_proj"
    for j, i in [(0, 0), (5, 131), (255, 511), (100, 300)]:
        r, k, g = i // 8, i % 8, i // 128
        q = (st[f"{p}.qweight"][r, j].item() >> (4 * k)) & 0xF
        z = ((st[f"{p}.qzeros"][g, j // 8].item() >> (4 * (j % 8))) & 0xF) + 1
        s = st[f"{p}.scales"][g, j].double().item()
        assert deq[j, i].item() == s * (q - z) == gptq.reference[f"{p}.weight"][j, i].item()


def test_gptq_classic_format_stores_zero_minus_one(gptq):
    st = load_file(str(gptq.path / "model.safetensors"))
    nibble = st["model.layers.0.self_attn.q_proj.qzeros"][0, 0].item() & 0xF
    assert nibble == 7  # zero point 8 for sym int4, stored minus one; loader adds it back
    edit_config(gptq.path, quantization_config={"checkpoint_format": "gptq_v2"})
    cfg, w = load_hf_weights(gptq.path)  # misread as v2: every weight shifts by one scale step
    ref = gptq.reference["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.allclose(w.layers[0].q.dequantize().double(), ref)


@pytest.mark.parametrize("change, match", [
    ({"desc_act": True}, "act-order"),
    ({"bits": 8}, "bits 8"),
    ({"sym": False}, "asymmetric"),
    ({"quant_method": "awq"}, "awq"),
    ({"checkpoint_format": "marlin"}, "marlin"),
])
def test_gptq_unsupported_quantization_config(gptq, change, match):
    edit_config(gptq.path, quantization_config=change)
    with pytest.raises(ModelFormatError, match=match):
        load_hf_weights(gptq.path)


def test_gptq_act_order_g_idx_is_refused(gptq):
    name = "model.layers.1.mlp.up_proj.g_idx"
    edit_tensors(gptq.path, lambda t: t.update({name: t[name].flip(0).contiguous()}))
    with pytest.raises(ModelFormatError, match="up_proj.g_idx.*act-order"):
        load_hf_weights(gptq.path)


def test_gptq_missing_qzeros_names_the_tensor(gptq):
    edit_tensors(gptq.path, lambda t: t.pop("model.layers.1.mlp.down_proj.qzeros"))
    with pytest.raises(ModelFormatError, match=r"model\.layers\.1\.mlp\.down_proj\.qzeros"):
        load_hf_weights(gptq.path)


def test_gptq_tensors_without_quantization_config(gptq):
    edit_config(gptq.path, quantization_config=None)
    with pytest.raises(ModelFormatError, match="no GPTQ quantization_config"):
        load_hf_weights(gptq.path)


# ---- broken files ---------------------------------------------------------------------------
def test_truncated_safetensors_names_the_file(gptq):
    file = gptq.path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ModelFormatError, match="model.safetensors.*(corrupt|truncated)"):
        load_hf_weights(gptq.path)


def test_garbage_safetensors_is_a_format_error(tmp_path):
    tm = make_tiny_llama(tmp_path)
    (tm.path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ModelFormatError, match="model.safetensors"):
        load_hf_weights(tm.path)


def test_missing_dense_tensor_names_it(tmp_path):
    tm = make_tiny_qwen3(tmp_path)
    edit_tensors(tm.path, lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"))
    with pytest.raises(ModelFormatError, match=r"model\.layers\.2\.self_attn\.k_norm\.weight"):
        load_hf_weights(tm.path)


def test_missing_shard_named_by_index(tmp_path):
    tm = make_tiny_llama(tmp_path, max_shard_size="100KB")
    victim = sorted(tm.path.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ModelFormatError, match=victim.name):
        load_hf_weights(tm.path)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    tm = make_tiny_llama(tmp_path)
    edit_config(tm.path, intermediate_size=96)
    with pytest.raises(ModelFormatError, match=r"gate_proj\.weight.*\(128, 64\).*\(96, 64\)"):
        load_hf_weights(tm.path)


@pytest.mark.parametrize("change, match", [
    ({"model_type": "mistral"}, "mistral"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "llama3"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_unsupported_or_incomplete_config(tmp_path, change, match):
    tm = make_tiny_llama(tmp_path)
    edit_config(tm.path, **change)
    with pytest.raises(ModelFormatError, match=match):
        load_hf_weights(tm.path)


def test_missing_config_json(tmp_path):
    with pytest.raises(ModelFormatError, match="config.json"):
        load_hf_weights(tmp_path)


# ---- tokenizer files ------------------------------------------------------------------------
def test_tiny_tokenizer_files_load_in_transformers(llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama.path))
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_id == 2 and len(tok) == 384
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"


def test_load_hf_dir_attaches_tokenizer(llama):
    mod = pytest.importorskip("replica.models.tokenizer", reason="replica/models/tokenizer.py not written yet")
    if not hasattr(getattr(mod, "Tokenizer", None), "from_hf_dir"):
        pytest.skip("Tokenizer.from_hf_dir not available yet")
    from tokenizers import Tokenizer as HFTokenizer

    loaded = load_hf_dir(llama.path)
    assert loaded.config == read_hf_config(llama.path)
    assert loaded.tokenizer is not None
    if hasattr(loaded.tokenizer, "encode"):
        expected = HFTokenizer.from_file(str(llama.path / "tokenizer.json")).encode("Hello, world!").ids
        assert list(loaded.tokenizer.encode("Hello, world!")) == expected
