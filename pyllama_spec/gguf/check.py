"""Read and validate GGUF files in pure Python, before llama.cpp sees them.

llama.cpp trusts much of what a GGUF file says: a flipped byte that makes two token
strings equal, a key stored with the wrong type, or a zero head count ends in a
``GGML_ASSERT`` (the process aborts) or a division by zero, not in an error code.
``validate_gguf`` reads the header, the key/values and the tensor infos (never the
tensor data: the data section is only measured against the file size), checks the
structure as ``ggml/src/gguf.cpp`` does, then the few semantic rules whose violation
llama.cpp (``src/llama-vocab.cpp``, ``src/llama-model.cpp``) or libmtmd
(``tools/mtmd/clip.cpp``) asserts on, and raises ``ModelFileError`` naming the file
and the problem.

``read_gguf`` is the one GGUF reader of the package (``gguf_writer.read_gguf_metadata``
uses it); it checks structure only.
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
    """The data of one F32 or F16 tensor of a file read by ``read_gguf``, as a numpy array of
    numpy shape (the reversed ggml dims), in the file's dtype (a copy: the file is closed again).

    Only what the package's own tools need (``widen.py`` reads the trained pair with it):
    other types raise ``ValueError``; a tensor the file does not hold, ``KeyError``.
    """
    t = info.tensors[name]
    dtype = {0: np.dtype("<f4"), 1: np.dtype("<f2")}.get(t.ggml_type)
    if dtype is None:
        raise ValueError(f"{info.path}: tensor {name!r} is {t.type_name}; read_tensor reads F32 and F16 only")
    with open(info.path, "rb") as f:
        f.seek(info.data_offset + t.offset)
        data = f.read(t.nbytes)
    if len(data) != t.nbytes:
        raise ModelFileError(f"GGUF file {info.path} is corrupt: tensor {name!r} is truncated")
    return np.frombuffer(data, dtype=dtype).reshape(tuple(reversed(t.dims))).copy()


def _type_name(t: tuple[ValueType, ValueType | None]) -> str:
    vtype, elem = t
    return f"ARRAY of {elem.name}" if elem is not None else vtype.name


# -- semantic checks ----------------------------------------------------------------
# Each rule below prevents a native abort, crash or hang, and its comment names what in llama.cpp
# would fire. Most were found by fuzzing (tests/test_gguf_fuzz.py: the embedded trained models;
# by hand also the tiny qwen2vl, qwen3vl and qwen35 sets); the expert-count, rope-scaling and
# token-array rules are the checks next to them in the same llama.cpp functions.

LLAMA_MAX_LAYERS = 512      # src/llama-hparams.h
LLAMA_MAX_EXPERTS = 1024
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
# What the graphs (src/models/<arch>.cpp) of the architectures this package serves assert about
# the head geometry, which the tensor shapes do not always pin down:
# n_embd_head_v == n_embd_head_k,
KV_HEADS_EQUAL = frozenset({"qwen2vl", "qwen3vl", "qwen3vlmoe", "hunyuan_vl", "qwen35", "qwen35moe", "qwen3",
                            "qwen3moe", "qwen3next", "qwen4exp", "llama", "minimax-01", "minimax-m2", "nemotron_h",
                            "muse-glimmer", "nanbeige", "dflash"})
# n_embd_head == n_rot,
ROPE_SPANS_THE_HEAD = frozenset({"llama", "qwen2vl", "qwen3vl", "qwen3vlmoe", "hunyuan_vl", "qwen3",
                                 "qwen3moe", "minimax-01", "minimax-m2"})
# and, where the Q weight is n_embd wide, a head split of exactly n_embd (ggml_reshape asserts).
Q_IS_N_EMBD = frozenset({"qwen2vl"})
# Gated-delta-net architectures: their tensors give each value head ssm.state_size dimensions,
# their graph ssm.inner_size / ssm.time_step_rank (src/models/qwen35.cpp and kin).
DELTA_NET_ARCHS = frozenset({"qwen35", "qwen35moe", "qwen3next"})
# ggml types ggml-cpu has no dot product for (intermediate types, integers): a matrix of one
# of these is a null function pointer in mul_mat (SIGSEGV), not an error.
NO_MATMUL_TYPES = frozenset({9, 15, 24, 25, 26, 27, 28})  # Q8_1, Q8_K, I8, I16, I32, I64, F64


def validate_gguf(path: str | os.PathLike, what: str = "model") -> GGUFInfo:
    """Check that llama.cpp / libmtmd can load ``path`` without aborting the process.

    ``what`` names the file's role in messages ("target model", "draft model", "mmproj").
    Reads only the header, the key/values and the tensor infos (milliseconds, whatever the
    size of the tensor data). Checks the structure (``read_gguf``), then what llama.cpp
    asserts on instead of returning an error: unique token strings, the layer count, the head
    and rope geometry, the deepstack and gated-delta-net sizes, tensor types ggml can compute
    with, and for a ``clip`` projector the key types, layer count, tensor shapes and the tensors
    its graph uses unconditionally. Raises
    ``ModelFileError`` ("<what> file <path> is corrupt: <problem>"); returns what it read, shared
    and read-only (see ``read_gguf_shared``): a file that passed before and is unchanged is not
    checked again.

    >>> validate_gguf("pyllama_spec/models/trained-target.gguf", "target model").arch   # doctest: +SKIP
    'hunyuan_vl'
    """
    info = read_gguf_shared(path, what)
    hit = _cached(Path(path))
    key = hit[0] if hit is not None and hit[1] is info else None
    if key is not None and key in _VALIDATED:
        return info
    fail = _fail_for(info.path, what)
    _check_tensor_types(info, fail)
    # libmtmd never looks at general.architecture: a file with clip keys is a projector to it
    if info.arch == "clip" or any(k.startswith("clip.") for k in info.metadata):
        _check_clip(info, fail)
    if info.arch != "clip":
        _check_vocab(info, fail)
        _check_hparams(info, fail)
    if key is not None:
        with _CACHE_LOCK:
            _VALIDATED.add(key)
    return info


def _scalar(info: GGUFInfo, key: str, vtype: ValueType = ValueType.UINT32):
    """The value of ``key`` if it is a scalar of ``vtype`` (llama.cpp's get_key throws a clean
    error on any other type, so only values of the type it reads need checking)."""
    return info.metadata[key] if info.types.get(key) == (vtype, None) else None


def _u32s(info: GGUFInfo, key: str):
    """A u32 key llama.cpp reads as one value or one per layer (get_key_or_arr), as an array."""
    if info.types.get(key) in ((ValueType.UINT32, None), (ValueType.ARRAY, ValueType.UINT32)):
        return np.atleast_1d(info.metadata[key])
    return np.zeros(0, np.uint32)


def _check_tensor_types(info: GGUFInfo, fail: Callable[[str], NoReturn]) -> None:
    for t in info.tensors.values():
        if t.ggml_type in NO_MATMUL_TYPES and len(t.dims) >= 2 and max(t.dims[1:]) > 1:
            fail(f"tensor {t.name!r} is a {t.type_name} matrix: ggml has no matrix product for {t.type_name}")
        # 1-D tensors (norms, biases, ssm_a ...) are added or multiplied onto F32 activations, and
        # ggml-cpu's binary ops take an F32 second operand only (binary-ops.cpp GGML_ABORT); the
        # converter and llama-quantize always keep them F32
        if len(t.dims) == 1 and t.ggml_type != 0:
            fail(f"tensor {t.name!r} is {t.type_name}; 1-D tensors (norms, biases) must be F32")


def _check_vocab(info: GGUFInfo, fail: Callable[[str], NoReturn]) -> None:
    tokens = info.metadata.get("tokenizer.ggml.tokens")
    if info.types.get("tokenizer.ggml.tokens") != (ValueType.ARRAY, ValueType.STRING):
        return  # missing or mistyped: llama-vocab throws (a clean error), nothing aborts
    # llama-vocab.cpp fills token_to_id from the list (an empty token becomes "[EMPTY_<id>]")
    # and then GGML_ASSERTs that no two ids share a string
    words = [w or f"[EMPTY_{i}]" for i, w in enumerate(tokens)] if "" in tokens else tokens
    if len(set(words)) != len(words):
        first: dict[str, int] = {}
        for i, w in enumerate(words):
            if w in first:
                fail(f"tokenizer.ggml.tokens has duplicate token strings (ids {first[w]} and {i}: {w!r})")
            first[w] = i
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        arr = info.metadata.get(key)
        if arr is not None and info.types[key][0] == ValueType.ARRAY and len(arr) < len(words):
            fail(f"{key} has {len(arr)} entries for {len(words)} tokens")


def _check_hparams(info: GGUFInfo, fail: Callable[[str], NoReturn]) -> None:
    arch = info.arch
    if arch is None:
        return  # llama.cpp refuses a file without an architecture cleanly
    meta = info.metadata

    def key(name: str) -> str:
        return f"{arch}.{name}"

    # llama-model.cpp load_hparams: GGML_ASSERT(n_layer > 0 && n_layer <= LLAMA_MAX_LAYERS) and the
    # expert-count asserts that follow it
    n_layer = _scalar(info, key("block_count"))
    if n_layer is not None and not 1 <= n_layer <= LLAMA_MAX_LAYERS:
        fail(f"{key('block_count')} is {n_layer}; llama.cpp needs 1 to {LLAMA_MAX_LAYERS} layers")
    nextn = _scalar(info, key("nextn_predict_layers"))
    if nextn is not None and n_layer is not None and nextn > n_layer:
        fail(f"{key('nextn_predict_layers')} is {nextn}, more than the {n_layer} layers")
    n_expert = _scalar(info, key("expert_count")) or 0
    if arch in ("hunyuan_vl", "hunyuan-dense") and n_expert <= 1:
        n_expert = 0  # llama.cpp ignores the experts of these dense models
    else:
        used = _u32s(info, key("expert_used_count"))
        n_used = int(used.max()) if used.size else 0
        if n_expert > LLAMA_MAX_EXPERTS:
            fail(f"{key('expert_count')} is {n_expert}, over llama.cpp's {LLAMA_MAX_EXPERTS}")
        if n_used > n_expert or (n_expert > 0 and n_used == 0):
            fail(f"{key('expert_used_count')} is {n_used} for {n_expert} experts")

    # qwen3vl.cpp adds deepstack slice i to layer i's output; the last layer keeps only the output
    # rows, so a slice there cannot broadcast (ggml_add asserts ggml_can_repeat)
    n_deepstack = _scalar(info, key("n_deepstack_layers"))
    if n_deepstack and n_layer is not None and n_deepstack >= n_layer:
        fail(f"{key('n_deepstack_layers')} is {n_deepstack}; a model of {n_layer} layers has at most {n_layer - 1}")
    # qwen35.cpp and kin: a layer is recurrent unless (il + 1) % full_attention_interval == 0
    if _scalar(info, key("full_attention_interval")) == 0:
        fail(f"{key('full_attention_interval')} is 0 (llama.cpp divides by it)")
    if arch in DELTA_NET_ARCHS:
        d_inner, d_state = _scalar(info, key("ssm.inner_size")), _scalar(info, key("ssm.state_size"))
        n_v_heads, n_k_heads = _scalar(info, key("ssm.time_step_rank")), _scalar(info, key("ssm.group_count"))
        if None not in (d_inner, d_state, n_v_heads, n_k_heads) and (
                not n_v_heads or not n_k_heads or d_inner != d_state * n_v_heads or n_v_heads % n_k_heads):
            # the graph divides by both head counts and GGML_ASSERTs their ratio; reshapes assert the sizes
            fail(f"{key('ssm.inner_size')} {d_inner}, {key('ssm.state_size')} {d_state}, "
                 f"{key('ssm.time_step_rank')} {n_v_heads} and {key('ssm.group_count')} {n_k_heads} disagree "
                 f"(inner size = state size x value heads, value heads a multiple of key heads)")

    # llama-model.cpp: GGML_ASSERT(rope_scaling_type != UNSPECIFIED) for an unknown name
    scaling = _scalar(info, key("rope.scaling.type"), ValueType.STRING)
    if scaling is not None and scaling not in ROPE_SCALING_TYPES:
        fail(f"{key('rope.scaling.type')} is {scaling!r}, not one of {', '.join(ROPE_SCALING_TYPES)}")

    # head geometry, computed as load_hparams does
    n_embd = _scalar(info, key("embedding_length"))
    heads = _u32s(info, key("attention.head_count"))
    n_head = int(heads[0]) if heads.size else None  # hparams.n_head() is layer 0's
    if not n_embd or not n_head:
        return  # no heads: llama.cpp skips the head geometry, and the tensor shapes catch the rest
    head_k = _scalar(info, key("attention.key_length")) or n_embd // n_head
    head_v = _scalar(info, key("attention.value_length")) or n_embd // n_head
    # llama.cpp multiplies heads by head size in uint32: a wrapped product can match the tensor
    # shapes while the graph reshapes with the real head count (ggml_reshape asserts)
    for name in ("attention.head_count", "attention.head_count_kv"):
        heads = _u32s(info, key(name))
        if heads.size and int(heads.max()) * max(head_k, head_v) >= 1 << 32:
            fail(f"{key(name)} is {int(heads.max())}: heads x head size {max(head_k, head_v)} overflows 32 bits")
    n_rot = _scalar(info, key("rope.dimension_count"))
    # ggml-cpu rope: GGML_ASSERT(n_dims <= ne0) and GGML_ASSERT(n_dims % 2 == 0); with n_dims 0
    # it never returns
    if n_rot is not None and (not 0 < n_rot <= head_k or n_rot % 2):
        fail(f"{key('rope.dimension_count')} is {n_rot}; rope needs an even width from 2 to the head size {head_k}")
    n_rot = head_k if n_rot is None else n_rot
    if arch in KV_HEADS_EQUAL and head_k != head_v:
        fail(f"the heads' keys are {head_k} wide and their values {head_v} (key_length / value_length; "
             f"llama.cpp's {arch} graph asserts they are equal)")
    if arch in Q_IS_N_EMBD and n_head * head_v != n_embd:
        fail(f"{key('attention.head_count')} is {n_head}: {n_head} heads of {head_v} do not make "
             f"{key('embedding_length')} {n_embd}")
    if arch in ROPE_SPANS_THE_HEAD and n_rot != head_v:
        fail(f"{key('rope.dimension_count')} is {n_rot} but the heads are {head_v} wide "
             f"(llama.cpp's {arch} graph asserts they are equal)")
    # ggml-cpu rope (ggml_mrope_cache_init): GGML_ASSERT(sum(sections) <= head size), and the
    # sum is a divisor
    sections = meta.get(key("rope.dimension_sections"))
    if info.types.get(key("rope.dimension_sections")) == (ValueType.ARRAY, ValueType.INT32) and len(sections) >= 4:
        s4 = [int(v) for v in sections[:4]]
        if min(s4) < 0 or not 0 < sum(s4) <= head_k:
            fail(f"{key('rope.dimension_sections')} is {s4}: each must be >= 0 and their sum in 1..{head_k} "
                 f"(the head size)")


# -- clip (mmproj) ---------------------------------------------------------------------

# The type clip.cpp reads each key as (tools/mtmd/clip.cpp get_u32/get_i32/get_f32/get_bool/
# get_string): gguf_get_val_<type> GGML_ASSERTs the stored type, so a flipped type byte aborts.
def _clip_key_types() -> dict[str, ValueType]:
    u32, i32, f32, b, s = ValueType.UINT32, ValueType.INT32, ValueType.FLOAT32, ValueType.BOOL, ValueType.STRING
    types = {
        "general.name": s, "general.description": s, "clip.projector_type": s,
        "clip.vision.projector_type": s, "clip.audio.projector_type": s, "clip.gen.audio.projector_type": s,
        "clip.gen.audio.model_variant": s, "clip.vision.mm_patch_merge_type": s,
        "clip.has_vision_encoder": b, "clip.has_audio_encoder": b, "clip.has_gen_audio_encoder": b,
        "clip.use_gelu": b, "clip.use_silu": b, "clip.minicpmv_version": i32, "clip.minicpmv_query_num": u32,
        "clip.vision.swiglu_clamp": f32,
    }
    for prefix in ("vision", "audio", "gen.audio"):
        for name in ("embedding_length", "feed_forward_length", "block_count", "projection_dim",
                     "attention.head_count", "attention.head_count_kv", "attention.head_dim"):
            types[f"clip.{prefix}.{name}"] = u32
        types[f"clip.{prefix}.attention.layer_norm_epsilon"] = f32
    for name in ("image_size", "patch_size", "image_min_pixels", "image_max_pixels", "preproc_min_tiles",
                 "preproc_max_tiles", "preproc_image_size", "projector.scale_factor", "projector.query_side",
                 "projector.window_side", "spatial_merge_size", "n_wa_pattern", "window_size", "sam.head_count",
                 "sam.block_count", "sam.embedding_length", "expert_used_count"):
        types[f"clip.vision.{name}"] = u32
    for name in ("num_mel_bins", "projector.stack_factor", "chunk_size", "conv_kernel_size", "max_pos_emb",
                 "projector.window_size", "projector.downsample_rate", "projector.head_count",
                 "rvq.num_quantizers", "window_size", "local_block_count", "local_group_size", "subsampling_factor"):
        types[f"clip.audio.{name}"] = u32
    return types


CLIP_KEY_TYPES = _clip_key_types()

# Tensors clip.cpp loads as optional but the Qwen-VL graphs (tools/mtmd/models/qwen2vl.cpp,
# qwen3vl.cpp) use unconditionally: a missing one is a null tensor in ggml_mul_mat / ggml_add
# (SIGSEGV) or a GGML_ASSERT. (model-wide names, per-layer suffixes)
_QWEN2VL_TENSORS = (("v.patch_embd.weight", "v.patch_embd.weight.1"),
                    ("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias", "attn_v.weight", "attn_v.bias"))
QWEN_VL_PROJECTORS = {
    "qwen2vl_merger": _QWEN2VL_TENSORS,
    "qwen2.5vl_merger": _QWEN2VL_TENSORS,
    "qwen3vl_merger": (("v.patch_embd.weight", "v.patch_embd.weight.1", "v.patch_embd.bias", "v.position_embd.weight"),
                       ("attn_qkv.weight", "attn_qkv.bias")),
}


def _check_clip(info: GGUFInfo, fail: Callable[[str], NoReturn]) -> None:
    for key, vtype in CLIP_KEY_TYPES.items():
        if key in info.types and info.types[key] != (vtype, None):
            fail(f"{key} is stored as {_type_name(info.types[key])}; clip.cpp reads it as {vtype.name}")
    tensors = info.tensors
    for t in tensors.values():
        # a bias is added to its weight's output (ggml_add asserts ggml_can_repeat)
        if t.name.endswith(".bias") and len(t.dims) == 1:
            w = tensors.get(t.name[:-len("bias")] + "weight")
            if w is not None and len(w.dims) in (1, 2, 4) and w.dims[-1] != t.dims[0]:
                fail(f"tensor {t.name!r} has {t.dims[0]} elements but {w.name!r} {list(w.dims)} has "
                     f"{w.dims[-1]} outputs")
    for modality, prefix in (("vision", "v"), ("audio", "a")):
        if info.metadata.get(f"clip.has_{modality}_encoder") is True:
            _check_clip_tower(info, fail, modality, prefix)


def _check_clip_tower(info: GGUFInfo, fail: Callable[[str], NoReturn], modality: str, prefix: str) -> None:
    def key(name: str) -> str:
        return f"clip.{modality}.{name}"

    tensors = info.tensors
    layers = sorted({int(n.split(".")[2]) for n in tensors
                     if n.startswith(f"{prefix}.blk.") and n.split(".")[2].isdigit()})
    n_layer = _scalar(info, key("block_count"))
    # clip.cpp sizes its layer table with block_count before it looks for the tensors: a huge
    # count allocates for minutes (or runs out of memory)
    # (and a graph without layers never uses its position input: GGML_ABORT "Failed to get tensor")
    if n_layer is not None and layers and not 1 <= n_layer <= len(layers):
        fail(f"{key('block_count')} is {n_layer} but the file has tensors for {len(layers)} {modality} layers")
    projector = _scalar(info, "clip.vision.projector_type", ValueType.STRING) \
        or _scalar(info, "clip.projector_type", ValueType.STRING)
    if modality != "vision" or projector not in QWEN_VL_PROJECTORS or not n_layer:
        return
    # the Qwen-VL graphs merge 2 x 2 patches whatever the key says, while the image is sized for
    # spatial_merge_size: any other value writes past the position buffers (heap corruption)
    merge = _scalar(info, "clip.vision.spatial_merge_size")
    if merge is not None and merge != 2:
        fail(f"clip.vision.spatial_merge_size is {merge}; the {projector} graph merges 2 x 2 patches")
    global_names, layer_suffixes = QWEN_VL_PROJECTORS[projector]
    for name in global_names:
        if name not in tensors:
            fail(f"tensor {name!r} is missing (the {projector} projector needs it)")
    for i in range(n_layer):
        for suffix in layer_suffixes:
            if f"v.blk.{i}.{suffix}" not in tensors:
                fail(f"tensor 'v.blk.{i}.{suffix}' is missing (the {projector} projector needs it)")
        # qwen3vl: a deepstack merger runs when its fc1 is there; without its fc2 its output is the
        # wrong width and the encoder writes past mtmd's buffer (GGML_ABORT)
        deepstack = {n for n in tensors if n.startswith(f"v.deepstack.{i}.")}
        for part in ("fc1.weight", "fc2.weight"):
            if deepstack and f"v.deepstack.{i}.{part}" not in deepstack:
                fail(f"tensor 'v.deepstack.{i}.{part}' is missing (deepstack merger {i} has the others)")
    # the Qwen-VL graphs reshape the activations with these hyperparameters (ggml_reshape asserts
    # the element count): they must match the tensors
    n_embd, n_head = _scalar(info, key("embedding_length")), _scalar(info, key("attention.head_count"))
    patch = _scalar(info, "clip.vision.patch_size")
    if n_head == 0:
        fail(f"{key('attention.head_count')} is 0 (the {projector} graph splits its attention into heads)")
    if not n_embd or not n_head or not patch:
        return  # clip.cpp refuses a missing or zero width or patch size itself
    d_head = _scalar(info, key("attention.head_dim")) or n_embd // n_head
    if d_head * n_head != n_embd:
        fail(f"{key('attention.head_count')} is {n_head}: {n_head} heads of {d_head} do not make "
             f"{key('embedding_length')} {n_embd}")
    expected = {"v.patch_embd.weight": (patch, patch, 3, n_embd), "v.patch_embd.weight.1": (patch, patch, 3, n_embd)}
    for i in range(n_layer):
        for suffix, dims in (("ln1.weight", (n_embd,)), ("ln2.weight", (n_embd,)), ("attn_q.weight", (n_embd, n_embd)),
                             ("attn_k.weight", (n_embd, n_embd)), ("attn_v.weight", (n_embd, n_embd)),
                             ("attn_qkv.weight", (n_embd, 3 * n_embd)), ("attn_out.weight", (n_embd, n_embd))):
            expected[f"v.blk.{i}.{suffix}"] = dims
    for name, dims in expected.items():
        t = tensors.get(name)
        if t is not None and t.dims != dims:
            fail(f"tensor {name!r} is {list(t.dims)} but embedding_length {n_embd}, patch_size {patch} "
                 f"make it {list(dims)}")
