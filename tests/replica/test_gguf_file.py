"""Our GGUF reader against gguf.GGUFReader (the reference): the same metadata values, the same
tensor table and data views, and a GGUFError (never another exception) for every cut of a header."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from replica.models.gguf_file import GGUFError, read_gguf
from replica.models.registry import embedded_gguf_path


def reference_value(field: gguf.ReaderField):
    """A gguf.ReaderField as a plain value: scalars, strings, and arrays of them."""
    main = field.types[0]
    if main == V.ARRAY:
        if field.types[-1] == V.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if main == V.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    return field.parts[-1].tolist()[0]


def assert_same_as_reference(path):
    ours, ref = read_gguf(path), gguf.GGUFReader(path)
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(ref_fields)
    for key, field in ref_fields.items():
        want = reference_value(field)
        assert ours.fields[key] == want, key
        assert type(ours.fields[key]) is type(want), key
    assert (ours.alignment, ours.data_offset) == (ref.alignment, ref.data_offset)
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.n_bytes) == (b.name, b.tensor_type, b.n_bytes)
        assert a.shape == tuple(int(n) for n in b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name
    return ours


def write_every_kind(path, alignment=None):
    """A small file with every value type and several tensor types, shapes and raw layouts."""
    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("k.u8", 250), w.add_int8("k.i8", -7), w.add_uint16("k.u16", 65000)
    w.add_int16("k.i16", -30000), w.add_uint32("k.u32", 4_000_000_000), w.add_int32("k.i32", -5)
    w.add_float32("k.f32", 0.1), w.add_uint64("k.u64", 2**63 + 5), w.add_int64("k.i64", -(2**40))
    w.add_float64("k.f64", 1e-300), w.add_bool("k.t", True), w.add_bool("k.f", False)
    w.add_string("k.s", "héllo 🙏"), w.add_string("k.empty", "")
    w.add_array("k.ints", [1, -2, 3]), w.add_array("k.floats", [0.5, -1.25])
    w.add_array("k.strs", ["a", "", "ü b"]), w.add_array("k.none", [])
    w.add_array("k.bools", [True, False, True])
    w.add_tensor("f32", rng.standard_normal((3, 5, 7)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 6)).astype(np.float16))
    w.add_tensor("i32", np.arange(9, dtype=np.int32))
    w.add_tensor("q8", rng.integers(0, 256, (2, 4, 2 * 34), dtype=np.uint8), raw_dtype=Q.Q8_0)
    w.add_tensor("q4_1", rng.integers(0, 256, (5, 20), dtype=np.uint8), raw_dtype=Q.Q4_1)
    w.add_tensor("bf16", rng.integers(0, 256, (3, 16), dtype=np.uint8), raw_dtype=Q.BF16)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_and_tensor_kind_matches_the_reference(tmp_path, alignment):
    write_every_kind(tmp_path / "kinds.gguf", alignment)
    ours = assert_same_as_reference(tmp_path / "kinds.gguf")
    assert ours.fields["k.u64"] == 2**63 + 5 and ours.fields["k.s"] == "héllo 🙏"
    assert ours.fields["k.strs"] == ["a", "", "ü b"] and ours.fields["k.t"] is True
    assert ours.alignment == (alignment or 32)
    assert {t.name: t.data.shape for t in ours.tensors}["q8"] == (2, 4, 68)


def test_the_embedded_model_matches_the_reference():
    ours = assert_same_as_reference(embedded_gguf_path())
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert ours.fields["general.architecture"] == "llama"


def test_every_cut_of_the_header_is_a_gguf_error(tmp_path):
    write_every_kind(tmp_path / "kinds.gguf")
    data = (tmp_path / "kinds.gguf").read_bytes()
    header_end = read_gguf(tmp_path / "kinds.gguf").data_offset
    cut = tmp_path / "cut.gguf"
    for n in range(0, header_end - 31):  # the last 0-31 bytes may be alignment padding
        cut.write_bytes(data[:n])
        with pytest.raises(GGUFError):
            read_gguf(cut)


@pytest.mark.parametrize("content,match", [
    (b"GGML\x03\x00\x00\x00" + bytes(16), "magic"),
    (b"GGUF\x07\x00\x00\x00" + bytes(16), "version 7"),
    (b"GGUF\x00\x00\x00\x03" + bytes(16), "big-endian"),
    (b"GGUF\x03\x00\x00\x00" + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
     + (1).to_bytes(8, "little") + b"k" + (99).to_bytes(4, "little"), "unknown GGUF value type 99"),
])
def test_bad_headers_say_what_is_wrong(tmp_path, content, match):
    (tmp_path / "bad.gguf").write_bytes(content)
    with pytest.raises(GGUFError, match=match):
        read_gguf(tmp_path / "bad.gguf")
