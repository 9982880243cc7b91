"""Read a GGUF file's metadata and tensor table: plain Python values and memory-mapped tensors.

gguf.GGUFReader builds one numpy view per array element, which costs about 7 s (two cores, one
process) for the 49k-token vocabulary and merges of the embedded model, and so dominated every
replica's start. This reader decodes the same file format with struct in a single pass over the
header and gives tensor data the same numpy shapes and dtypes as gguf.GGUFReader (the tests hold
it to that reference). Little-endian GGUF v2/v3 only, the byte order every converter writes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType

VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value types (gguf.GGUFValueType): scalar code → struct format
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_STRUCTS: dict[str, struct.Struct] = {}
# tensor types whose data the reader types by element (any other is raw bytes per row)
_ELEMENT_DTYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                   GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                   GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                   GGMLQuantizationType.I64: np.int64}


class GGUFError(ValueError):
    """The file is not a GGUF file we can read (bad magic, version, a short or garbled header)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: shape in GGUF order (innermost first); data is a read-only view of the file,
    shaped outermost first ([..., out, in] typed, or [..., out, bytes per row] for block types)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """Metadata as plain values (int, float, bool, str, or lists of them) and the tensor table."""

    fields: dict[str, Any]
    tensors: list[GGUFTensor]
    version: int
    alignment: int
    data_offset: int


class _Cursor:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: Any, pos: int = 0) -> None:
        self.buf, self.pos = buf, pos

    def take(self, fmt: str) -> Any:
        s = _STRUCTS.get(fmt) or _STRUCTS.setdefault(fmt, struct.Struct(fmt))
        (value,) = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFError(f"a string of {n} bytes at offset {self.pos} runs past the end of the file")
        s = bytes(self.buf[self.pos:end]).decode("utf-8")
        self.pos = end
        return s

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take("<" + _SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.take("<I"), self.take("<Q")
            if item == _STRING:
                return [self.string() for _ in range(n)]
            if item in _SCALARS:
                fmt = "<" + _SCALARS[item]
                size = struct.calcsize(fmt) * n
                if self.pos + size > len(self.buf):
                    raise GGUFError(f"an array of {n} values at offset {self.pos} runs past the end")
                arr = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=n, offset=self.pos)
                self.pos += size
                return arr.tolist()
            if item == _ARRAY:  # nested arrays: legal, unused by any model key we read
                return [self.value(_ARRAY) for _ in range(n)]
            raise GGUFError(f"unknown GGUF array item type {item}")
        raise GGUFError(f"unknown GGUF value type {kind}")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse `path`; GGUFError for a file that is not readable GGUF. Tensor data is mapped, not read."""
    path = Path(path)
    with open(path, "rb") as f:
        size = path.stat().st_size
        if size == 0:
            raise GGUFError("the file is empty")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(buf, path)
    except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise GGUFError(f"garbled or truncated header ({type(e).__name__}: {e})") from e
    finally:
        buf.close()  # values were copied out; tensors map the file on their own


def _parse(buf: Any, path: Path) -> GGUFFile:
    c = _Cursor(buf)
    if c.take("<I") != GGUF_MAGIC:
        raise GGUFError("GGUF magic invalid")
    version = c.take("<I")
    if version not in VERSIONS:
        raise GGUFError(f"GGUF version {version} is not supported (big-endian files are not "
                        f"either); supported: {', '.join(map(str, VERSIONS))}")
    n_tensors, n_kv = c.take("<Q"), c.take("<Q")
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        fields[key] = c.value(c.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.take("<Q") for _ in range(c.take("<I")))
        infos.append((name, dims, c.take("<I"), c.take("<Q")))
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"general.alignment {alignment!r} is not a power of two")
    data_offset = -(-c.pos // alignment) * alignment
    whole = np.memmap(path, dtype=np.uint8, mode="r")
    tensors, seen = [], set()
    for name, dims, raw_type, offset in infos:
        if name in seen:
            raise GGUFError(f"tensor {name} appears twice")
        seen.add(name)
        tensors.append(_tensor(whole, name, dims, raw_type, data_offset + offset))
    return GGUFFile(fields=fields, tensors=tensors, version=version, alignment=alignment,
                    data_offset=data_offset)


def _tensor(whole: np.ndarray, name: str, dims: tuple[int, ...], raw_type: int,
            start: int) -> GGUFTensor:
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise GGUFError(f"tensor {name} has unknown type {raw_type}") from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
    n_bytes = n_elems * type_size // block
    shape = tuple(reversed(dims))  # outermost first
    raw = whole[start:start + n_bytes]  # short when the file is cut short: the loader checks
    if qtype in _ELEMENT_DTYPES:
        dtype = np.dtype(_ELEMENT_DTYPES[qtype])
        data = raw[:raw.size - raw.size % dtype.itemsize].view(dtype)
    else:
        if shape and shape[-1] % block:
            raise GGUFError(f"tensor {name}: row of {shape[-1]} is not a multiple of "
                            f"{qtype.name}'s block of {block}")
        shape = (*shape[:-1], shape[-1] // block * type_size) if shape else shape
        data = raw
    if raw.size == n_bytes:
        data = data.reshape(shape)
    return GGUFTensor(name=name, tensor_type=qtype, shape=dims, n_bytes=n_bytes, data=data)
