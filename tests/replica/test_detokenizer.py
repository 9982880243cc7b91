"""The incremental Detokenizer hands out exactly the deltas of decoding the whole output at
every step (the behaviour it replaces), on the real SmolLM2 tokenizer and the synthetic byte
tokenizer: stop strings, holds of a possible stop prefix, and UTF-8 sequences split across
tokens included."""

from __future__ import annotations

import functools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replica.models.gguf_file import read_gguf
from replica.models.registry import embedded_gguf_path
from replica.models.synthetic import ByteTokenizer
from replica.models.tokenizer import Tokenizer
from replica.request import Detokenizer


class FullDecode:
    """The reference: decode every output id at each step, search the whole text."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.emitted = 0
        self.stopped = False

    def stable(self, ids, final):
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        hit = -1
        for s in self.stop:
            i = text.find(s)
            if i >= 0 and (hit < 0 or i < hit):
                hit = i
        if hit >= 0:
            return text[:hit], True
        if final:
            return text, False
        keep = len(text)
        while keep and text[keep - 1] == "\ufffd":
            keep -= 1
        for n in range(min(self.max_stop - 1, keep), 0, -1):
            if any(s.startswith(text[keep - n: keep]) for s in self.stop):
                keep -= n
                break
        return text[:keep], False

    def skip(self, ids):
        self.emitted = len(self.stable(ids, final=False)[0])

    def delta(self, ids, final):
        text, self.stopped = self.stable(ids, final)
        out = text[self.emitted:]
        self.emitted = max(self.emitted, len(text))
        return out


@functools.lru_cache(maxsize=1)
def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf(embedded_gguf_path()).fields)


@functools.lru_cache(maxsize=None)
def partial_ids(name: str) -> list[int]:
    """Ids whose text alone is an incomplete UTF-8 sequence: they make splits across tokens."""
    tok = tokenizer(name)
    return [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])][:2000]


def tokenizer(name: str):
    return smollm2() if name == "smollm2" else ByteTokenizer(320)


def run(detok, ids, resume: int, stop_after: int | None = None):
    """Per-step (text, stopped) of a stream whose first `resume` tokens were delivered before."""
    detok.skip(ids[:resume])
    out = []
    for n in range(resume + 1, len(ids) + 1):
        text = detok.delta(ids[:n], final=n == len(ids))
        out.append((text, detok.stopped))
        if detok.stopped:
            break
    return out


def sequences(name: str, vocab: int):
    specials = [0, 1, 2] if name == "smollm2" else [256, 257, 258, 300]
    token = st.one_of(st.integers(0, vocab - 1), st.sampled_from(partial_ids(name)),
                      st.sampled_from(specials), st.integers(0, 255) if name == "bytes"
                      else st.sampled_from([28, 216, 198, 33, 253]))
    return st.lists(token, min_size=1, max_size=60)


def check(name: str, data) -> None:
    tok = tokenizer(name)
    ids = data.draw(sequences(name, tok.vocab_size), label="ids")
    text = tok.decode(ids, skip_special_tokens=True)
    stops = []
    for _ in range(data.draw(st.integers(0, 3), label="n_stops")):
        if text and data.draw(st.booleans()):  # a piece of the real text: it will hit
            a = data.draw(st.integers(0, len(text) - 1))
            stops.append(text[a: a + data.draw(st.integers(1, 6))])
        else:
            stops.append(data.draw(st.sampled_from(["\n", "the", "é", "\ufffd", ".\n\n", "<|im_end|>",
                                                     "zzzzzzzz", " a"])))
    resume = data.draw(st.integers(0, len(ids) - 1), label="resume")
    stop = tuple(stops)
    assert run(Detokenizer(tok, stop), ids, resume) == run(FullDecode(tok, stop), ids, resume)


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_incremental_equals_full_decode_on_smollm2(data):
    check("smollm2", data)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_incremental_equals_full_decode_on_the_byte_tokenizer(data):
    check("bytes", data)


def test_a_long_output_decodes_a_bounded_window_per_token():
    """The cost of a token does not grow with the output: each decode call sees a few ids."""
    tok = smollm2()
    seen = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            seen.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode("The quick brown fox jumps over the lazy dog. héllo wörld 日本語 🤖 " * 40)
    detok, ref = Detokenizer(Counting(), ("zebra",)), FullDecode(tok, ("zebra",))
    for n in range(1, len(ids) + 1):
        assert detok.delta(ids[:n], final=n == len(ids)) == ref.delta(ids[:n], n == len(ids))
    assert len(ids) > 500 and max(seen) <= 8


@settings(max_examples=500, deadline=None)
@given(tail=st.text(alphabet="ab\ufffdé ", max_size=12),
       stop=st.lists(st.text(alphabet="ab\ufffdé ", min_size=1, max_size=8), min_size=1, max_size=3))
def test_stop_prefix_is_the_longest_tail_suffix_that_begins_a_stop_string(tail, stop):
    want = next((n for n in range(len(tail), 0, -1)
                 if any(s.startswith(tail[len(tail) - n:]) for s in stop)), 0)
    assert Detokenizer(ByteTokenizer(320), tuple(stop))._stop_prefix(tail) == want
