"""Our engine vs transformers (the reference), on the embedded GGUF and tiny random models."""

from __future__ import annotations

import pytest
import torch

from replica import Engine, EngineConfig, Request, SamplingParams
from replica.models.hf_loader import load_hf_dir
from replica.models.registry import embedded_gguf_path
from replica.models.transformer import Transformer
from tests.replica import tiny_models
from tests.replica.reference import all_logits

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def engine():
    with Engine(EngineConfig()) as e:
        yield e


@pytest.fixture(scope="module")
def hf_gguf():
    transformers = pytest.importorskip("transformers")
    path = embedded_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    _never_stop(model)
    return model


def _never_stop(hf) -> None:
    """Make transformers generate a fixed number of tokens with EOS as an ordinary token — what
    our ignore_eos does (min_new_tokens would instead forbid EOS and change the argmax)."""
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0


def test_embedded_gguf_greedy_matches_transformers(engine, hf_gguf):
    """Greedy 40 tokens, several prompts, batched together on our side: identical ids."""
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ours = engine.generate([Request(prompt_token_ids=tuple(i), params=params) for i in ids])
    for prompt_ids, out in zip(ids, ours):
        with torch.inference_mode():
            ref = hf_gguf.generate(torch.tensor([prompt_ids]), max_new_tokens=40, do_sample=False, attention_mask=torch.ones(1, len(prompt_ids),
                                                                              dtype=torch.long))
        assert out.token_ids == ref[0, len(prompt_ids):].tolist()


def test_embedded_gguf_logits_close_to_transformers(engine, hf_gguf):
    ids = engine.tokenizer.encode("Paris is the capital and largest city of France, with")
    ours = all_logits(engine.core.model, ids)
    with torch.inference_mode():
        ref = hf_gguf(torch.tensor([ids])).logits[0]
    assert torch.isfinite(ours).all()
    err = (ours - ref).abs().max() / ref.abs().max()
    assert err < 1e-4, float(err)


def test_chat_answers_capital_of_france(engine):
    out = engine.generate([Request(messages=({"role": "user",
                                              "content": "What is the capital of France?"},),
                                   params=SamplingParams(max_tokens=48, temperature=0.0))])[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("builder", ["make_tiny_llama", "make_tiny_qwen3", "make_tiny_qwen3_moe",
                                     "make_tiny_gptq_llama"])
def test_tiny_models_match_transformers(builder, tmp_path):
    tiny = getattr(tiny_models, builder)(tmp_path / builder, seed=3)
    loaded = load_hf_dir(tiny.path)
    model = Transformer(loaded.config, loaded.weights)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, loaded.config.vocab_size, (37,), generator=g).tolist()
    ours = all_logits(model, ids)
    hf = tiny.model.float().eval()
    _never_stop(hf)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    err = (ours - ref).abs().max() / ref.abs().max()
    assert err < 1e-4, float(err)
    # greedy continuation through the whole engine equals transformers' generate
    with Engine(EngineConfig(model=str(tiny.path), num_kv_blocks=64), loaded=loaded) as e:
        out = e.generate([Request(prompt_token_ids=tuple(ids[:9]),
                                  params=SamplingParams(max_tokens=16, temperature=0.0,
                                                        ignore_eos=True))])[0]
    with torch.inference_mode():
        gen = hf.generate(torch.tensor([ids[:9]]), max_new_tokens=16, do_sample=False, attention_mask=torch.ones(1, 9, dtype=torch.long))
    assert out.token_ids == gen[0, 9:].tolist()
