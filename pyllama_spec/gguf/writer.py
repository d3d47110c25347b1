"""A small GGUF v3 writer, numpy only (the reader is ``gguf_check.read_gguf``).

GGUF layout written here:

    "GGUF" | u32 version=3 | u64 n_tensors | u64 n_kv
    n_kv  x (string key | u32 value type | value)
    n_tensors x (string name | u32 n_dims | u64 dims[n_dims] | u32 ggml type | u64 offset)
    zero padding to `general.alignment`
    tensor data, each tensor starting at an aligned offset

Strings are u64 length + UTF-8 bytes; arrays are u32 element type + u64 count +
elements.  Dims are in ggml order (fastest varying first), i.e. the reversed
numpy shape.  Only F32 and F16 tensors are supported: enough for tiny test
models.  Output is deterministic: keys and tensors keep insertion order.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from pathlib import Path
from typing import Any, Sequence

import numpy as np

# The format's constants and value types live with the reader (gguf_check); re-exported here.
from pyllama_spec.gguf.reader import (  # noqa: F401
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_VERSION,
    ValueType,
    read_gguf,
)
from pyllama_spec.gguf.reader import SCALAR_FORMAT as _SCALAR_FORMAT


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    I64 = 27  # index tensors, e.g. an EAGLE3 draft's d2t


_NUMPY_TO_GGML = {np.dtype(np.float32): GGMLType.F32, np.dtype(np.float16): GGMLType.F16,
                  np.dtype(np.int64): GGMLType.I64}


def _pack_string(s: str) -> bytes:
    data = s.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _pack_value(vtype: ValueType, value: Any) -> bytes:
    if vtype == ValueType.STRING:
        return _pack_string(value)
    if vtype == ValueType.ARRAY:
        raise TypeError("nested arrays are not supported")
    return struct.pack(_SCALAR_FORMAT[vtype], value)


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class GGUFWriter:
    """Collects key/values and tensors, then writes one GGUF v3 file.

    Typed adders (``add_uint32``, ``add_string``, ``add_array`` ...) record
    metadata; ``add_tensor`` records a float32/float16 numpy array under a
    ggml tensor name; ``write(path)`` (or ``to_bytes()``) serialises it all.
    """

    def __init__(self, alignment: int = DEFAULT_ALIGNMENT):
        self.alignment = alignment
        self._kv: dict[str, bytes] = {}
        self._tensors: dict[str, np.ndarray] = {}
        if alignment != DEFAULT_ALIGNMENT:
            self.add_uint32("general.alignment", alignment)

    # -- metadata -----------------------------------------------------------
    def add_value(self, key: str, vtype: ValueType, value: Any) -> None:
        if key in self._kv:
            raise KeyError(f"duplicate GGUF key {key!r}")
        self._kv[key] = struct.pack("<I", vtype) + _pack_value(vtype, value)

    def add_array(self, key: str, elem_type: ValueType, values: Sequence[Any]) -> None:
        if key in self._kv:
            raise KeyError(f"duplicate GGUF key {key!r}")
        body = b"".join(_pack_value(elem_type, v) for v in values)
        self._kv[key] = struct.pack("<IIQ", ValueType.ARRAY, elem_type, len(values)) + body

    def add_uint8(self, key: str, v: int) -> None: self.add_value(key, ValueType.UINT8, v)
    def add_int8(self, key: str, v: int) -> None: self.add_value(key, ValueType.INT8, v)
    def add_uint16(self, key: str, v: int) -> None: self.add_value(key, ValueType.UINT16, v)
    def add_int16(self, key: str, v: int) -> None: self.add_value(key, ValueType.INT16, v)
    def add_uint32(self, key: str, v: int) -> None: self.add_value(key, ValueType.UINT32, v)
    def add_int32(self, key: str, v: int) -> None: self.add_value(key, ValueType.INT32, v)
    def add_uint64(self, key: str, v: int) -> None: self.add_value(key, ValueType.UINT64, v)
    def add_int64(self, key: str, v: int) -> None: self.add_value(key, ValueType.INT64, v)
    def add_float32(self, key: str, v: float) -> None: self.add_value(key, ValueType.FLOAT32, v)
    def add_float64(self, key: str, v: float) -> None: self.add_value(key, ValueType.FLOAT64, v)
    def add_bool(self, key: str, v: bool) -> None: self.add_value(key, ValueType.BOOL, bool(v))
    def add_string(self, key: str, v: str) -> None: self.add_value(key, ValueType.STRING, v)

    # -- tensors ------------------------------------------------------------
    def add_tensor(self, name: str, array: np.ndarray) -> None:
        """Add a tensor; ``array`` has numpy (row-major) shape, e.g. [n_vocab, n_embd]."""
        array = np.ascontiguousarray(array)
        if array.dtype not in _NUMPY_TO_GGML:
            raise TypeError(f"{name}: only float32/float16/int64 tensors are supported, got {array.dtype}")
        if name in self._tensors:
            raise KeyError(f"duplicate tensor {name!r}")
        self._tensors[name] = array

    # -- output -------------------------------------------------------------
    def to_bytes(self) -> bytes:
        out = bytearray(GGUF_MAGIC)
        out += struct.pack("<IQQ", GGUF_VERSION, len(self._tensors), len(self._kv))
        for key, packed in self._kv.items():
            out += _pack_string(key) + packed
        offset = 0
        for name, array in self._tensors.items():
            dims = tuple(reversed(array.shape)) or (1,)
            out += _pack_string(name) + struct.pack("<I", len(dims))
            out += struct.pack(f"<{len(dims)}Q", *dims)
            out += struct.pack("<IQ", _NUMPY_TO_GGML[array.dtype], offset)
            offset = _align(offset + array.nbytes, self.alignment)
        out += bytes(_align(len(out), self.alignment) - len(out))
        for array in self._tensors.values():
            data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
            out += data + bytes(_align(len(data), self.alignment) - len(data))
        return bytes(out)

    def write(self, path: str | Path) -> None:
        Path(path).write_bytes(self.to_bytes())


def read_gguf_metadata(path: str | Path, *, with_tensors: bool = False) -> dict[str, Any]:
    """Read the key/values of a GGUF file into a dict (for tests and error messages).

    Arrays come back as lists. With ``with_tensors=True`` the dict also holds
    ``"__tensors__"``: a mapping tensor name -> (ggml dims, ggml type id).
    A corrupt file raises ``ModelFileError`` (see ``gguf_check.read_gguf``).
    """
    info = read_gguf(path)
    meta: dict[str, Any] = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in info.metadata.items()}
    if with_tensors:
        meta["__tensors__"] = {t.name: (t.dims, t.ggml_type) for t in info.tensors.values()}
    return meta
