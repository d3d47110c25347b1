"""Read GGUF files in pure Python: the one GGUF reader of the package. It checks structure only
(header, key/values, tensor infos, measured against the file size, as ``ggml/src/gguf.cpp``
does); ``check.validate_gguf`` adds the rules llama.cpp asserts on. ``writer.read_gguf_metadata``
and the memory estimate use it too.
"""

from __future__ import annotations

import collections
import hashlib
import mmap
import os
import struct
import threading
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, Callable, NoReturn

import numpy as np

from pyllama_spec.errors import ModelFileError

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# numpy dtype of each fixed-size value type (little endian); BOOL is one byte
_VALUE_DTYPE = {
    ValueType.UINT8: np.dtype("<u1"), ValueType.INT8: np.dtype("<i1"), ValueType.UINT16: np.dtype("<u2"),
    ValueType.INT16: np.dtype("<i2"), ValueType.UINT32: np.dtype("<u4"), ValueType.INT32: np.dtype("<i4"),
    ValueType.FLOAT32: np.dtype("<f4"), ValueType.BOOL: np.dtype("<u1"), ValueType.UINT64: np.dtype("<u8"),
    ValueType.INT64: np.dtype("<i8"), ValueType.FLOAT64: np.dtype("<f8"),
}
# struct format of each fixed-size value type (the writer packs with it too)
SCALAR_FORMAT = {
    ValueType.UINT8: "<B", ValueType.INT8: "<b", ValueType.UINT16: "<H", ValueType.INT16: "<h",
    ValueType.UINT32: "<I", ValueType.INT32: "<i", ValueType.FLOAT32: "<f", ValueType.BOOL: "<?",
    ValueType.UINT64: "<Q", ValueType.INT64: "<q", ValueType.FLOAT64: "<d",
}

# ggml type id -> (name, elements per block, bytes per block): ggml/src/ggml.c type_traits of the
# pinned tree (ids 4, 5, 31-33, 36-38 were removed; gguf.cpp refuses them, as it does ids >= 43).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18), 42: ("Q2_0", 64, 18),
}

GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64            # a tensor name is stored in char[GGML_MAX_NAME] with its NUL
GGUF_MAX_LENGTH = 1 << 30     # gguf.cpp: GGUF_MAX_STRING_LENGTH and GGUF_MAX_ARRAY_ELEMENTS
_INT64_MAX = (1 << 63) - 1
# smallest possible encoding of one key/value (u64 length, a 1-byte key, u32 type, a 1-byte value)
# and of one tensor info (u64 length, u32 n_dims = 0, u32 type, u64 offset)
_MIN_KV_BYTES = 8 + 1 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it. ``dims`` are in ggml order (fastest first)."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int    # from the start of the data section
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0]


@dataclass
class GGUFInfo:
    """What ``read_gguf`` / ``validate_gguf`` found in a file (metadata and tensor infos only).

    ``metadata`` maps key -> value: Python scalars, ``str``, a numpy array for a numeric
    array, a list of ``str`` for a string array. Strings are decoded as UTF-8 with
    ``surrogateescape`` (lossless: bytes that are not UTF-8 survive, and compare as bytes).
    ``types`` maps key -> (value type, element type or None).
    """

    path: Path
    version: int
    file_size: int
    alignment: int
    data_offset: int
    metadata: dict[str, Any] = field(default_factory=dict)
    types: dict[str, tuple[ValueType, ValueType | None]] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def arch(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None


def _count(n: int) -> str:
    """A count for a message: huge ones (a corrupt length) also as a power of two."""
    return f"{n} (~2^{n.bit_length() - 1})" if n >= 1 << 32 else str(n)


def _decode(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


class _Parser:
    """Walks a GGUF header in a read-only buffer (a mmap of the file), checking every
    length against the bytes that are left before using it."""

    def __init__(self, buf, size: int, fail: Callable[[str], NoReturn]):
        self.buf, self.size, self.fail, self.pos = buf, size, fail, 0

    def take(self, n: int, what: str) -> int:
        """Reserve ``n`` bytes for ``what``; return where they start."""
        if n > self.size - self.pos:
            self.past_end(what, n, self.pos)
        start = self.pos
        self.pos += n
        return start

    def past_end(self, what: str, n: int, at: int) -> NoReturn:
        self.fail(f"{what} would need {_count(n)} bytes at offset {at}, past the end of the file ({self.size} bytes)")

    def scalar(self, fmt: str, what: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> bytes:
        n = self.scalar("<Q", f"the length of {what}")
        if n > GGUF_MAX_LENGTH:
            self.fail(f"{what} has length {_count(n)} (over gguf's limit of 2^30 bytes)")
        start = self.take(n, f"{what} ({n} bytes)")
        return self.buf[start:start + n]

    def value(self, vtype: int, key: str) -> Any:
        """A scalar or string value of type ``vtype`` (arrays: ``array``)."""
        if vtype == ValueType.STRING:
            return _decode(self.string(f"the value of {key!r}"))
        if vtype not in SCALAR_FORMAT:
            self.fail(f"key {key!r} has invalid value type {vtype}")
        return self.scalar(SCALAR_FORMAT[ValueType(vtype)], f"the value of {key!r}")

    def array(self, elem: int, key: str) -> Any:
        """The count and elements of an array whose element type ``elem`` was just read."""
        if elem not in _VALUE_DTYPE and elem != ValueType.STRING:
            self.fail(f"array {key!r} has invalid element type {elem}"
                      + (" (nested arrays are not allowed)" if elem == ValueType.ARRAY else ""))
        n = self.scalar("<Q", f"the length of array {key!r}")
        if n > GGUF_MAX_LENGTH:
            self.fail(f"array {key!r} has {_count(n)} elements (over gguf's limit of 2^30)")
        if elem == ValueType.STRING:
            return self.string_array(n, key)
        dtype = _VALUE_DTYPE[ValueType(elem)]
        start = self.take(n * dtype.itemsize, f"array {key!r} ({_count(n)} x {ValueType(elem).name})")
        if n == 0:
            return np.empty(0, bool if elem == ValueType.BOOL else dtype)
        arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=start).copy()  # a copy lets the mmap close
        return arr.astype(bool) if elem == ValueType.BOOL else arr

    def string_array(self, n: int, key: str) -> list[str]:
        # every element has at least its u64 length: refuse a huge count before looping
        if n * 8 > self.size - self.pos:
            self.fail(f"array {key!r} says {_count(n)} strings but only {self.size - self.pos} bytes are left "
                      f"(each needs at least 8)")
        buf, size, pos, unpack = self.buf, self.size, self.pos, struct.Struct("<Q").unpack_from
        out = [b""] * n
        for i in range(n):  # the hot loop of a real tokenizer (150k tokens): keep it lean
            if pos + 8 > size:
                self.past_end(f"the length of string {i} of array {key!r}", 8, pos)
            (ln,) = unpack(buf, pos)
            pos += 8
            if ln > size - pos:
                self.past_end(f"string {i} of array {key!r}", ln, pos)
            out[i] = buf[pos:pos + ln]
            pos += ln
        self.pos = pos
        return [b.decode("utf-8", "surrogateescape") for b in out]


def _fail_for(path: Path, what: str) -> Callable[[str], NoReturn]:
    def fail(problem: str) -> NoReturn:
        raise ModelFileError(f"{what} file {path} is corrupt: {problem}")
    return fail


# Files read (and validated) before: one load() reads its target several times (validation,
# the context-length and memory checks, the native load's own check), and a Qwen-sized
# vocabulary costs 0.2 s to parse. An entry is reused only while the bytes it was parsed
# from (everything before the tensor data) hash the same, so a file rewritten in place, even
# within one timestamp tick, is read again. Only successful reads are kept.
_READ_CACHE: "collections.OrderedDict[tuple, tuple[bytes, GGUFInfo]]" = collections.OrderedDict()
_VALIDATED: set[tuple] = set()  # (path, size, digest) of files that passed validate_gguf
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 8


def _header_digest(path: Path, n_bytes: int) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return hashlib.blake2b(f.read(n_bytes), digest_size=16).digest()
    except OSError:
        return None


def _cached(path: Path) -> tuple[tuple, GGUFInfo] | None:
    """(identity, info) of an earlier successful read of this unchanged file, or None."""
    try:
        where = (str(path.resolve()), path.stat().st_size)
    except OSError:
        return None  # the read itself reports the problem
    with _CACHE_LOCK:
        entry = _READ_CACHE.get(where)
    if entry is None:
        return None
    digest, info = entry
    if _header_digest(path, info.data_offset) != digest:
        return None
    return (*where, digest), info


def _remember(path: Path, info: GGUFInfo) -> None:
    try:
        where = (str(path.resolve()), path.stat().st_size)
    except OSError:
        return
    digest = _header_digest(path, info.data_offset)
    if digest is None or where[1] != info.file_size:
        return
    with _CACHE_LOCK:
        _READ_CACHE[where] = (digest, info)
        _READ_CACHE.move_to_end(where)
        while len(_READ_CACHE) > _CACHE_SIZE:
            _READ_CACHE.popitem(last=False)


def validation_key(path: str | os.PathLike, info: GGUFInfo) -> tuple | None:
    """The cache key of ``info`` when it is the shared reading of the unchanged ``path`` (None
    otherwise): what check.validate_gguf remembers a passed validation by."""
    hit = _cached(Path(path))
    return hit[0] if hit is not None and hit[1] is info else None


def was_validated(key: tuple | None) -> bool:
    return key is not None and key in _VALIDATED


def remember_validated(key: tuple | None) -> None:
    if key is not None:
        with _CACHE_LOCK:
            _VALIDATED.add(key)


def read_gguf(path: str | os.PathLike, what: str = "GGUF") -> GGUFInfo:
    """Read the header, key/values and tensor infos of a GGUF file (not the tensor data).

    Checks the structure as llama.cpp's ``gguf.cpp`` does, and every length against the
    file size before it is used; raises ``ModelFileError`` ("<what> file <path> is corrupt:
    ...") on the first problem. Each call returns a fresh object (the caller may change it).

    >>> info = read_gguf("pyllama_spec/models/trained-target.gguf")      # doctest: +SKIP
    >>> info.arch, info.tensors["output_norm.weight"].dims
    ('hunyuan_vl', (64,))
    """
    return _read_gguf_file(Path(path), what)


def read_gguf_shared(path: str | os.PathLike, what: str = "GGUF") -> GGUFInfo:
    """``read_gguf``, but a file read before and unchanged since is not parsed again: the
    object is shared between callers, so it must be treated as read-only."""
    hit = _cached(Path(path))
    if hit is not None:
        return hit[1]
    info = _read_gguf_file(Path(path), what)
    _remember(Path(path), info)
    return info


def _read_gguf_file(path: Path, what: str) -> GGUFInfo:
    fail = _fail_for(path, what)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                magic = f.read(4)
                if magic != GGUF_MAGIC:
                    fail(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
                fail(f"the file has {size} bytes, less than a GGUF header (24)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, size, path, fail)
    except OSError as e:
        if isinstance(e, ModelFileError):
            raise
        raise ModelFileError(f"{what} file {path} cannot be read: {e}") from e


def _parse(buf, size: int, path: Path, fail: Callable[[str], NoReturn]) -> GGUFInfo:
    p = _Parser(buf, size, fail)
    magic = buf[0:4]
    if magic != GGUF_MAGIC:
        fail(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    p.pos = 4
    version = p.scalar("<I", "the version")
    if version & 0xFFFF == 0:
        fail(f"GGUF version {version:#x} (a big-endian file, or a corrupt header)")
    if version not in (2, 3):
        fail(f"GGUF version {version}; llama.cpp reads versions 2 and 3")
    n_tensors = p.scalar("<Q", "the tensor count")
    n_kv = p.scalar("<Q", "the key/value count")
    # a count is at least as many minimal entries as the file could hold: refuse 2^60 before looping
    if n_kv * _MIN_KV_BYTES > size - p.pos:
        fail(f"the header says {_count(n_kv)} key/values but the file has only {size} bytes")
    if n_tensors * _MIN_TENSOR_INFO_BYTES > size - p.pos:
        fail(f"the header says {_count(n_tensors)} tensors but the file has only {size} bytes")

    info = GGUFInfo(path=path, version=version, file_size=size, alignment=DEFAULT_ALIGNMENT, data_offset=0)
    meta, types = info.metadata, info.types
    for i in range(n_kv):
        key = _decode(p.string(f"the name of key/value {i}"))
        if not key:
            fail(f"key/value {i} has an empty name")
        if key in meta:
            fail(f"key {key!r} appears twice (key/value {i})")
        vtype = p.scalar("<i", f"the type of key {key!r}")
        if vtype == ValueType.ARRAY:
            elem = p.scalar("<i", f"the element type of array {key!r}")
            meta[key] = p.array(elem, key)
            types[key] = (ValueType.ARRAY, ValueType(elem))
        else:
            meta[key] = p.value(vtype, key)
            types[key] = (ValueType(vtype), None)

    if "general.alignment" in meta:
        if types["general.alignment"] != (ValueType.UINT32, None):
            fail(f"general.alignment has type {_type_name(types['general.alignment'])}, expected UINT32")
        info.alignment = meta["general.alignment"]
        if info.alignment == 0 or info.alignment & (info.alignment - 1):
            fail(f"general.alignment is {info.alignment}, not a power of 2")

    expected_offset = 0
    for i in range(n_tensors):
        raw_name = p.string(f"the name of tensor {i}")
        name = _decode(raw_name)
        if len(raw_name) >= GGML_MAX_NAME:
            fail(f"tensor {i} has a name of {len(raw_name)} bytes (ggml allows {GGML_MAX_NAME - 1}): {name[:80]!r}")
        if name in info.tensors:
            fail(f"tensor {name!r} appears twice (tensor {i})")
        n_dims = p.scalar("<I", f"the dimension count of tensor {name!r}")
        if n_dims > GGML_MAX_DIMS:
            fail(f"tensor {name!r} has {n_dims} dimensions (ggml allows at most {GGML_MAX_DIMS})")
        dims = struct.unpack_from(f"<{n_dims}q", buf, p.take(8 * n_dims, f"the dimensions of tensor {name!r}"))
        if any(d <= 0 for d in dims):
            fail(f"tensor {name!r} has dimensions {list(dims)} (each must be at least 1)")
        n_elements = 1
        for d in dims:
            if n_elements > _INT64_MAX // d:
                fail(f"tensor {name!r} has dimensions {list(dims)}: more than 2^63 elements")
            n_elements *= d
        gtype = p.scalar("<i", f"the type of tensor {name!r}")
        if gtype not in GGML_TYPES:
            fail(f"tensor {name!r} has unknown ggml type {gtype}")
        type_name, block, type_size = GGML_TYPES[gtype]
        row = dims[0] if dims else 1
        if row % block:
            fail(f"tensor {name!r} of type {type_name} has rows of {row} elements, "
                 f"not a multiple of its block size {block}")
        nbytes = n_elements // block * type_size
        offset = p.scalar("<Q", f"the data offset of tensor {name!r}")
        # gguf.cpp requires the tensors to be packed in order, each at an aligned offset
        if offset != expected_offset:
            fail(f"tensor {name!r} has data offset {_count(offset)}, expected {expected_offset} "
                 f"(tensors are stored in order, each padded to {info.alignment} bytes)")
        expected_offset += -(-nbytes // info.alignment) * info.alignment
        info.tensors[name] = TensorInfo(name, tuple(dims), gtype, offset, nbytes)

    info.data_offset = -(-p.pos // info.alignment) * info.alignment
    for t in info.tensors.values():
        end = info.data_offset + t.offset + t.nbytes
        if end > size:
            fail(f"tensor {t.name!r} ({t.type_name} {list(t.dims)}) extends to byte {end} "
                 f"but the file has {size} bytes (truncated?)")
    return info


def read_tensor(info: GGUFInfo, name: str) -> np.ndarray:
    """The data of one F32, F16 or I64 tensor of a file read by ``read_gguf``, as a numpy array of
    numpy shape (the reversed ggml dims), in the file's dtype (a copy: the file is closed again).

    Only what the package's own tools need (``widen.py`` reads the trained pair with it):
    other types raise ``ValueError``; a tensor the file does not hold, ``KeyError``.
    """
    t = info.tensors[name]
    dtype = {0: np.dtype("<f4"), 1: np.dtype("<f2"), 27: np.dtype("<i8")}.get(t.ggml_type)
    if dtype is None:
        raise ValueError(f"{info.path}: tensor {name!r} is {t.type_name}; read_tensor reads F32, F16 and I64 only")
    with open(info.path, "rb") as f:
        f.seek(info.data_offset + t.offset)
        data = f.read(t.nbytes)
    if len(data) != t.nbytes:
        raise ModelFileError(f"GGUF file {info.path} is corrupt: tensor {name!r} is truncated")
    return np.frombuffer(data, dtype=dtype).reshape(tuple(reversed(t.dims))).copy()


def _type_name(t: tuple[ValueType, ValueType | None]) -> str:
    vtype, elem = t
    return f"ARRAY of {elem.name}" if elem is not None else vtype.name
