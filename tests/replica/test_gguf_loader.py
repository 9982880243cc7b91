"""GGUF loading: config from metadata, weights equal to transformers' dequantized ones, typed errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels.linear import from_gguf
from replica.errors import ModelFormatError, UnknownModelError
from replica.models.gguf_file import read_gguf
from replica.models.gguf_loader import load_gguf
from replica.models.registry import embedded_gguf_path, resolve_model

LAYERS = (0, 1, 14, 29)
PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
               "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
               "down": "mlp.down_proj"}
NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


@pytest.fixture(scope="module")
def model():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def hf_state():
    """transformers' own GGUF load (dequantized to fp32, q/k un-permuted): the reference."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    path = embedded_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32)
    tied = hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return {k: v.detach() for k, v in hf.state_dict().items()}, tied


def test_config_from_gguf_metadata(model):
    c = model.config
    assert (c.name, c.arch) == ("smollm2-135m", "llama")
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.max_position, c.rope_theta) == (49152, 8192, 100000.0)
    assert c.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert c.tie_word_embeddings and not c.qk_norm and not c.is_moe and not c.synthetic
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert model.tokenizer.eos_token_ids == (2,)


def test_weights_keep_their_storage_format(model):
    w = model.weights
    assert (w.embed.fmt, w.embed.out_features, w.embed.in_features) == ("q8", 49152, 576)
    assert len(w.layers) == 30
    layer = w.layers[0]
    assert {name: getattr(layer, name).fmt for name in PROJECTIONS} == dict.fromkeys(PROJECTIONS, "q4")
    assert (layer.q.out_features, layer.k.out_features, layer.down.in_features) == (576, 192, 1536)
    assert layer.attn_norm.dtype == torch.float32 and layer.attn_norm.shape == (576,)
    assert w.final_norm.shape == (576,)


def test_lm_head_is_the_embedding_object(model, hf_state):
    _, hf_tied = hf_state
    assert hf_tied and model.weights.lm_head is model.weights.embed


def test_embedding_and_final_norm_equal_transformers(model, hf_state):
    state, _ = hf_state
    assert torch.equal(model.weights.embed.dequantize(), state["model.embed_tokens.weight"])
    assert torch.equal(model.weights.final_norm, state["model.norm.weight"])
    ids = torch.tensor([0, 1, 2, 19556, 49151])
    assert torch.equal(model.weights.embed.rows(ids), state["model.embed_tokens.weight"][ids])


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("name", list(PROJECTIONS))
def test_projection_equals_transformers(model, hf_state, layer, name):
    state, _ = hf_state
    ours = getattr(model.weights.layers[layer], name).dequantize()
    ref = state[f"model.layers.{layer}.{PROJECTIONS[name]}.weight"]
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("name", list(NORMS))
def test_norm_equals_transformers(model, hf_state, layer, name):
    state, _ = hf_state
    assert torch.equal(getattr(model.weights.layers[layer], name),
                       state[f"model.layers.{layer}.{NORMS[name]}.weight"])


@pytest.mark.parametrize("name,n_head", [("attn_q", 9), ("attn_k", 3)])
def test_q_k_file_order_differs_and_is_undone(model, hf_state, name, n_head):
    # Guard against a vacuous pass: the file's rows really are in llama.cpp's permuted order.
    state, _ = hf_state
    raw = next(t for t in read_gguf(embedded_gguf_path()).tensors if t.name == f"blk.0.{name}.weight")
    in_file = from_gguf(raw.tensor_type.name, raw.data, int(raw.shape[1]), int(raw.shape[0])).dequantize()
    ref = state[f"model.layers.0.self_attn.{name[-1]}_proj.weight"]
    assert not torch.equal(in_file, ref)
    assert torch.equal(torch.from_numpy(_permute(ref.numpy(), n_head)), in_file)


# ---- a tiny hand-written GGUF: exact un-permutation and each error path -----------------------
TINY = dict(hidden=64, heads=4, kv_heads=2, ffn=64, vocab=260)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's permute for interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny(path, arch="llama", v_type=None, rng=None):
    """One-layer model with F32 weights in HF order (q/k permuted on write as llama.cpp does)."""
    rng = rng or np.random.default_rng(0)
    h, nh, nkv, f, vocab = (TINY[k] for k in ("hidden", "heads", "kv_heads", "ffn", "vocab"))
    hd = h // nh
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1), w.add_context_length(128), w.add_embedding_length(h)
    w.add_feed_forward_length(f), w.add_head_count(nh), w.add_head_count_kv(nkv)
    w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-6)
    tokens = [chr(c) for c in range(33, 127)] + [f"<t{i}>" for i in range(vocab - 94 - 3)] \
        + ["ab", "<|im_start|>", "<|im_end|>"]
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("smollm"), w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 2) + [3, 3]), w.add_token_merges(["a b"])
    w.add_bos_token_id(vocab - 2), w.add_eos_token_id(vocab - 1)
    hf = {"q": rng.standard_normal((h, h)), "k": rng.standard_normal((nkv * hd, h))}
    mat = lambda o, i: rng.standard_normal((o, i)).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", mat(vocab, h))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(h, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(h, np.float32))
    w.add_tensor("blk.0.attn_q.weight", _permute(hf["q"], nh).astype(np.float32))
    w.add_tensor("blk.0.attn_k.weight", _permute(hf["k"], nkv).astype(np.float32))
    if v_type is None:
        w.add_tensor("blk.0.attn_v.weight", mat(nkv * hd, h))
    else:  # raw blocks of another ggml type (22 bytes per 32 weights for Q5_0)
        w.add_tensor("blk.0.attn_v.weight", np.zeros((nkv * hd, h // 32 * 22), np.uint8), raw_dtype=v_type)
    w.add_tensor("blk.0.attn_output.weight", mat(h, h))
    for name, shape in (("ffn_gate", (f, h)), ("ffn_up", (f, h)), ("ffn_down", (h, f))):
        w.add_tensor(f"blk.0.{name}.weight", mat(*shape))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return {k: torch.from_numpy(v.astype(np.float32)) for k, v in hf.items()}


def test_tiny_gguf_q_and_k_come_back_in_hf_order(tmp_path):
    hf = _write_tiny(tmp_path / "tiny.gguf")
    m = load_gguf(tmp_path / "tiny.gguf")
    assert (m.config.num_heads, m.config.num_kv_heads, m.config.head_dim) == (4, 2, 16)
    assert m.config.tie_word_embeddings and m.weights.lm_head is m.weights.embed
    assert torch.equal(m.weights.layers[0].q.dequantize(), hf["q"])
    assert torch.equal(m.weights.layers[0].k.dequantize(), hf["k"])
    assert m.tokenizer.eos_token_ids == (TINY["vocab"] - 1,)


def test_missing_file(tmp_path):
    with pytest.raises(ModelFormatError, match="no such GGUF file"):
        load_gguf(tmp_path / "absent.gguf")


@pytest.mark.parametrize("content", ["first_megabyte", "random", "empty", "magic_only"])
def test_corrupt_or_truncated_file(tmp_path, content):
    real = embedded_gguf_path()
    data = {"first_megabyte": lambda: real.open("rb").read(1 << 20),
            "random": lambda: np.random.default_rng(1).bytes(1 << 16),
            "empty": lambda: b"",
            "magic_only": lambda: b"GGUF\x03\x00\x00\x00"}[content]()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    with pytest.raises(ModelFormatError) as err:
        load_gguf(bad)
    assert str(bad) in err.value.message and "truncated or corrupt" in err.value.message


def test_tensor_data_cut_short(tmp_path):
    _write_tiny(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelFormatError, match="cut.gguf"):
        load_gguf(tmp_path / "cut.gguf")


def test_unsupported_architecture(tmp_path):
    _write_tiny(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelFormatError, match="unsupported architecture 'gpt2'"):
        load_gguf(tmp_path / "gpt2.gguf")


def test_unsupported_tensor_type(tmp_path):
    _write_tiny(tmp_path / "q5.gguf", v_type=gguf.GGMLQuantizationType.Q5_0)
    with pytest.raises(ModelFormatError, match="blk.0.attn_v.weight has unsupported type Q5_0"):
        load_gguf(tmp_path / "q5.gguf")


# ---- registry ---------------------------------------------------------------------------------
def test_embedded_path_is_the_shipped_gguf():
    path = embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000


def test_gguf_path_spec_loads_that_file(tmp_path):
    _write_tiny(tmp_path / "tiny.gguf")
    assert resolve_model(str(tmp_path / "tiny.gguf")).config.name == "tiny"
    with pytest.raises(ModelFormatError, match="no such GGUF file"):
        resolve_model(str(tmp_path / "missing.gguf"))


@pytest.mark.parametrize("spec", ["gpt-4", "", "   ", "/no/such/dir"])
def test_unknown_spec_lists_what_is_accepted(spec):
    with pytest.raises(UnknownModelError) as err:
        resolve_model(spec)
    assert "smollm2-135m" in err.value.message and ".gguf" in err.value.message


def test_unknown_synthetic_preset_is_unknown_model():
    with pytest.raises(UnknownModelError, match="no-such-preset"):
        resolve_model("synthetic:no-such-preset")
