"""Our GGUF tokenizer against transformers' tokenizer built from the same GGUF."""

from __future__ import annotations

import json
import unicodedata

import pytest

from replica.errors import InvalidRequestError
from replica.models.gguf_file import read_gguf
from replica.models.registry import embedded_gguf_path
from replica.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CHAT_TEXT = ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
             "<|im_start|>assistant\n")
STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "don't you'll I'M we've THEY'RE",
    "12345 3.14159",
    "1,000,000 and 0.5% of -42",
    "def f(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "import numpy as np\n\nnp.zeros((3, 4), dtype=np.float32)",
    "héllo wörld — naïve café",
    "日本語のテキストと中文",
    "Здравствуй, мир",
    "emoji: 🤖🎉👍🏽 and ❤️",
    "a\n\n\nb",
    "trailing spaces   ",
    "   leading spaces",
    "word    word\t\ttab",
    "\n",
    " ",
    "",
    "<|im_start|>user\nhi<|im_end|>\n",
    CHAT_TEXT,
    "<|endoftext|>after end",
    "mixed<|im_end|>special<|im_start|>",
    "https://example.com/path?q=1&r=two#frag",
    "\"quotes\" and 'apostrophes' — “curly” ‘ones’",
]
# Whitespace runs just before a digit: llama.cpp's "smollm" pre-tokenizer (and SmolLM's own
# tokenizer.json) isolate digits first, so "  1" is ["ĠĠ", "1"]; transformers' GGUF converter
# (5.x) has no "smollm" entry and falls back to plain GPT-2 splitting, giving ["Ġ", "Ġ", "1"].
DIGIT_AFTER_WHITESPACE = ["  1", "x  12", "a\n\n3", "\t\t7 days", "total:    100"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another\nplease  🙏"}],
    [{"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def gguf_file():
    return embedded_gguf_path()


@pytest.fixture(scope="module")
def ours(gguf_file) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf(gguf_file).fields)


@pytest.fixture(scope="module")
def hf(gguf_file):
    return transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


@pytest.mark.parametrize("text", STRINGS)
def test_encode_matches_transformers(ours, hf, text):
    assert ours.encode(text) == hf(text)["input_ids"]


@pytest.mark.parametrize("text", DIGIT_AFTER_WHITESPACE)
def test_digits_are_split_off_before_byte_level_like_llama_cpp(ours, hf, text):
    # The "smollm" rule: cut the text before and after every digit, then GPT-2-split each piece.
    pieces, cur = [], ""
    for ch in text:
        if unicodedata.category(ch).startswith("N"):
            pieces += [cur, ch] if cur else [ch]
            cur = ""
        else:
            cur += ch
    pieces += [cur] if cur else []
    expected = [i for piece in pieces for i in hf(piece)["input_ids"]]
    assert ours.encode(text) == expected


def test_two_spaces_then_digit_is_one_double_space_token(ours):
    assert ours.encode("  1") == [ours.token_to_id("ĠĠ"), ours.token_to_id("1")]


def test_special_ids_and_sizes(ours, hf):
    assert ours.vocab_size == 49152 == len(hf)
    assert ours.bos_token_id == 1 and ours.token_to_id("<|im_start|>") == 1
    assert ours.eos_token_ids == (2,) and ours.token_to_id("<|im_end|>") == 2
    assert ours.token_to_id("no-such-token") is None
    assert ours.encode("Hi")[0] != ours.bos_token_id  # add_bos_token is False in this GGUF


@pytest.mark.parametrize("text", [s for s in STRINGS if "<|" not in s] + DIGIT_AFTER_WHITESPACE)
def test_decode_round_trips(ours, hf, text):
    ids = ours.encode(text)
    assert ours.decode(ids) == text
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_decode_skips_special_tokens_unless_asked(ours, hf):
    ids = ours.encode(CHAT_TEXT)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert "<|im_start|>" not in ours.decode(ids)
    assert ours.decode(ids, skip_special_tokens=False) == CHAT_TEXT


def test_partial_utf8_decodes_to_replacement_char(ours):
    ids = ours.encode("🤖")
    assert len(ids) > 1 and "\ufffd" in ours.decode(ids[:1])


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(ours, hf, messages):
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    rendered = ours.apply_chat_template(messages)
    assert rendered == expected
    assert rendered.endswith("<|im_start|>assistant\n")
    assert ours.encode(rendered) == hf(expected)["input_ids"]


def test_chat_template_without_generation_prompt(ours, hf):
    messages = CONVERSATIONS[1]
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == \
        hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


def test_chat_template_adds_default_system_message(ours):
    rendered = ours.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.parametrize("messages", [
    [],
    "hello",
    None,
    ["not a dict"],
    [{"role": "robot", "content": "beep"}],
    [{"content": "no role"}],
    [{"role": "user"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
    [{"role": "user", "content": "ok"}, {"role": "assistant", "content": 4}],
])
def test_bad_messages_raise_invalid_request(ours, messages):
    with pytest.raises(InvalidRequestError) as err:
        ours.apply_chat_template(messages)
    assert err.value.param == "messages" and "messages" in err.value.message


def test_template_raise_exception_becomes_invalid_request(ours):
    strict = Tokenizer(ours._backend, chat_template="{{ raise_exception('roles must alternate') }}",
                       bos_token_id=None, eos_token_ids=(2,), template_tokens={})
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        strict.apply_chat_template([{"role": "user", "content": "x"}])


def test_from_hf_dir_matches_transformers(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    for text in STRINGS:
        assert tok.encode(text) == hf(text)["input_ids"], text
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, 0)
    for messages in CONVERSATIONS:
        assert tok.apply_chat_template(messages) == \
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
