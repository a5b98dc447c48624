"""A GGUF file's header and tensor directory, read in well under a second.

The ``gguf`` package's reader builds a numpy view for every part of every key (each of a 262k-token vocabulary's
strings, their scores and types): 3 s on SmolLM2's file and 11 s on Gemma 3's, paid on every load. This reader
walks the same bytes with ``struct`` and keeps arrays as spans of the file, decoded only when a key is asked for;
tensors are views of one memory map. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serval.errors import ModelFileError

# Value types: struct formats of the scalar ones; 8 is a string, 9 an array.
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                  12: "<d"}
STRING, ARRAY = 8, 9
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
DEFAULT_ALIGNMENT = 32
# Tensor types stored as plain numbers (ggml type → numpy); every other type is blocks of bytes.
_PLAIN_TENSOR_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
                       28: np.float64}
# ggml's tensor types that Serval reads: id → (name, weights a block, bytes a block), as the gguf package's
# GGMLQuantizationType and GGML_QUANT_SIZES give them (tests/test_gguf_reader.py), without importing that package
# (0.1 s of every start); other ids are looked up there.
_GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
               6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84),
               11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
               24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8)}


def ggml_type(tensor_type: int) -> tuple[str, int, int]:
    """(name, weights a block, bytes a block) of a ggml tensor type id; ValueError for an id ggml does not know."""
    if tensor_type in _GGML_TYPES:
        return _GGML_TYPES[tensor_type]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType(tensor_type)
    return (qtype.name, *GGML_QUANT_SIZES[qtype])


@dataclass
class GGUFField:
    """One header key: its value type, the item type of an array (else None), and where its value starts."""
    type: int
    item_type: int | None
    offset: int
    count: int  # items of an array; 1 otherwise


@dataclass
class GGUFTensor:
    """A tensor's directory entry. ``shape`` is GGUF's order (innermost first), ``tensor_type`` the ggml type."""
    name: str
    shape: tuple[int, ...]
    tensor_type: int
    data: np.ndarray  # a view of the file: numbers [*reversed(shape)] for plain types, else bytes [rows..., row bytes]


class GGUFContents:
    """The fields and tensors of a GGUF file; ``value(key)`` decodes a field when asked."""

    def __init__(self, path: str | Path) -> None:
        """Reads the header and the tensor directory; raises ModelFileError (one line naming the file and the fault)
        for an empty file, another format, a header cut short or damaged, or tensor data past the file's end."""
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise ModelFileError(f"{self.path}: the file is empty")
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._buf[:4] != b"GGUF":
            raise ModelFileError(f"{self.path}: not a GGUF file (it begins with {bytes(self._buf[:4])!r}, not "
                                 "b'GGUF')")
        try:
            entries, data_start = self._read_header()
        except (struct.error, UnicodeDecodeError, OverflowError, MemoryError, ZeroDivisionError) as exc:
            raise ModelFileError(f"{self.path}: the GGUF header is cut short or damaged ({exc})") from None
        file_bytes = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.tensors = [GGUFTensor(name, shape, tensor_type, self._tensor_view(file_bytes, data_start + offset, shape,
                                                                               tensor_type, name))
                        for name, shape, tensor_type, offset in entries]

    def _read_header(self) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int]:
        """Reads the key/value pairs into ``fields``; returns the tensor directory's entries (name, shape, type,
        offset) and where the tensors' data starts."""
        buf = self._buf
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ModelFileError(f"{self.path}: GGUF version {version} is not supported (need 2 or later)")
        pos = 24
        self.fields: dict[str, GGUFField] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if vtype == ARRAY:
                item_type, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                self.fields[key] = GGUFField(vtype, item_type, pos, count)
                pos = self._skip_items(item_type, count, pos)
            else:
                self.fields[key] = GGUFField(vtype, None, pos, 1)
                pos = self._skip_items(vtype, 1, pos)
            if pos > len(buf):
                raise struct.error(f"key {key!r} runs past the end of the file")
        self.metadata_end = pos  # where the key/value pairs end and the tensor directory starts
        entries = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            shape = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            tensor_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            entries.append((name, tuple(int(d) for d in shape), tensor_type, offset))
        alignment = int(self.value("general.alignment", DEFAULT_ALIGNMENT))
        return entries, -(-pos // alignment) * alignment

    def _tensor_view(self, file_bytes: np.ndarray, start: int, shape: tuple[int, ...], tensor_type: int,
                     name: str) -> np.ndarray:
        end = start + _tensor_bytes(shape, tensor_type, self.path, name)
        if end > len(file_bytes):
            raise ModelFileError(f"{self.path}: the file is cut short (a download or copy that stopped?): tensor "
                                 f"{name} ends at byte {end:,}, the file has {len(file_bytes):,}")
        return _tensor_view(file_bytes, start, shape, tensor_type, name)

    def value(self, key: str, default: Any = None) -> Any:
        """A field's value: a Python scalar or str, or a list for an array; ``default`` where the key is missing."""
        field = self.fields.get(key)
        if field is None:
            return default
        if field.type != ARRAY:
            return self._item(field.type, field.offset)[0]
        if field.item_type in _NUMPY_TYPES:
            return np.frombuffer(self._buf, _NUMPY_TYPES[field.item_type], field.count, field.offset).tolist()
        items, pos = [], field.offset
        for _ in range(field.count):
            item, pos = self._item(field.item_type, pos)
            items.append(item)
        return items

    def array_length(self, key: str) -> int | None:
        """The item count of an array field, without decoding it (None where the key is missing or not an array)."""
        field = self.fields.get(key)
        return field.count if field is not None and field.type == ARRAY else None

    def metadata_digest(self) -> str:
        """sha256 of the header's key/value bytes: files with the same metadata (a copy, the same model written
        twice) have the same digest whatever their path or time."""
        return hashlib.sha256(self._buf[24: self.metadata_end]).hexdigest()

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, pos)
        return self._buf[pos + 8: pos + 8 + n].decode("utf-8"), pos + 8 + n

    def _item(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype in SCALAR_FORMATS:
            fmt = SCALAR_FORMATS[vtype]
            return struct.unpack_from(fmt, self._buf, pos)[0], pos + struct.calcsize(fmt)
        if vtype == STRING:
            return self._string(pos)
        if vtype == ARRAY:
            item_type, count = struct.unpack_from("<IQ", self._buf, pos)
            items, pos = [], pos + 12
            for _ in range(count):
                item, pos = self._item(item_type, pos)
                items.append(item)
            return items, pos
        raise ModelFileError(f"{self.path}: unknown GGUF value type {vtype} (a damaged header?)")

    def _skip_items(self, vtype: int, count: int, pos: int) -> int:
        if vtype in SCALAR_FORMATS:
            return pos + count * struct.calcsize(SCALAR_FORMATS[vtype])
        if vtype == STRING:
            unpack, buf = struct.unpack_from, self._buf
            for _ in range(count):
                pos += 8 + unpack("<Q", buf, pos)[0]
            return pos
        if vtype == ARRAY:
            for _ in range(count):
                item_type, n = struct.unpack_from("<IQ", self._buf, pos)
                pos = self._skip_items(item_type, n, pos + 12)
            return pos
        raise ModelFileError(f"{self.path}: unknown GGUF value type {vtype} (a damaged header?)")


def _tensor_bytes(shape: tuple[int, ...], tensor_type: int, path: Path, name: str) -> int:
    """Bytes of a tensor's data in the file."""
    count = int(np.prod(shape, dtype=np.int64))
    if tensor_type in _PLAIN_TENSOR_TYPES:
        return count * np.dtype(_PLAIN_TENSOR_TYPES[tensor_type]).itemsize
    try:
        _, block_size, type_size = ggml_type(tensor_type)
    except ValueError:
        raise ModelFileError(f"{path}: tensor {name} has an unknown ggml type {tensor_type}") from None
    return count // block_size * type_size


def _tensor_view(file_bytes: np.ndarray, start: int, shape: tuple[int, ...], tensor_type: int,
                 name: str) -> np.ndarray:
    rows_first = tuple(reversed(shape))
    if tensor_type in _PLAIN_TENSOR_TYPES:
        dtype = np.dtype(_PLAIN_TENSOR_TYPES[tensor_type])
        count = int(np.prod(shape, dtype=np.int64))
        return file_bytes[start: start + count * dtype.itemsize].view(dtype).reshape(rows_first)
    try:
        _, block_size, type_size = ggml_type(tensor_type)
    except ValueError:
        raise ValueError(f"tensor {name}: unknown ggml type {tensor_type}") from None
    row_bytes = shape[0] // block_size * type_size
    rows = int(np.prod(shape[1:], dtype=np.int64))
    return file_bytes[start: start + rows * row_bytes].reshape(*rows_first[:-1], row_bytes)
