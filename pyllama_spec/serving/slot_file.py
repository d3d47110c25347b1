"""Slot files: one slot's cache written to disk and read back (llama-server's
``POST /slots/{id}?action=save|restore``; ``Sequence.save_state`` / ``restore_state`` take it out
of the context and put it back).

A file is ``MAGIC``, the header's length (4 bytes, little-endian), the header (JSON), then the
target's memory of the sequence as llama.cpp serializes it. The header says which files made it
(the target's and the projector's size and the SHA-256 of their first 4 MiB) and the KV cache
types, what the cache holds (text tokens, and media items by content id with their rows and
positions: their positions follow from these), the position mode, and the size and SHA-256 of the
memory that follows.

``read`` checks all of it against this engine before a byte reaches native code: a file from
another model, projector or cache layout, a truncated or altered one, tokens outside the
vocabulary, a cache that cannot fit the slot: each is a ``SlotFileError`` (a ValueError) that says
what is wrong. It reads the memory only once the header passed, so a file made for a bigger
context or another model costs its header alone, and one whose memory claims more than a slot of
this model can hold (``memory_bound``) is refused before it is read. Pure Python: the native part is the
Sequence's.

The drafter's state is not saved: a restored slot's drafter starts afresh (see
``Sequence.restore_state``), and the output is the same as with a fresh server.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import stat
import struct
import uuid
from pathlib import Path

import numpy as np

from pyllama_spec.errors import PyllamaError
from pyllama_spec.speculative.positions import DRAFT_POSITION_MODES
from pyllama_spec.speculative.sequence import CachedMedia, SavedSequence

MAGIC = b"PYLLSLOT"
VERSION = 1
#: How much of a model or projector file its identity hashes (GGUF metadata, tensor infos and the
#: start of the weights: a file of another model differs there).
IDENTITY_BYTES = 4 * 2**20
_PREFIX = struct.Struct("<8sI")  # magic, header length


class SlotFileError(PyllamaError, ValueError):
    """A slot file that cannot be restored here, and why."""


@dataclasses.dataclass(frozen=True)
class SlotIdentity:
    """What a slot file must have been made with to be restored here."""

    model: dict  # file_identity of the target
    projector: dict | None  # file_identity of the projector (None: no projector)
    cache: dict  # the target's KV cache types {"type_k", "type_v"}
    lora: tuple = ()  # file_identity of each LoRA adapter of the target, in id order


def file_identity(path: str | os.PathLike) -> dict:
    """A file's size and the SHA-256 of its first ``IDENTITY_BYTES``."""
    with open(path, "rb") as f:
        head = f.read(IDENTITY_BYTES)
        size = os.fstat(f.fileno()).st_size
    return {"size": size, "sha256": hashlib.sha256(head).hexdigest()}


def identity(model_path, projector_path, *, type_k: str, type_v: str, lora_paths=()) -> SlotIdentity:
    """The identity of an engine's files and cache (reads up to 4 MiB of each file)."""
    return SlotIdentity(file_identity(model_path), file_identity(projector_path) if projector_path else None,
                        {"type_k": type_k, "type_v": type_v}, tuple(file_identity(p) for p in lora_paths))


def write(path: str | os.PathLike, saved: SavedSequence, ident: SlotIdentity, lora_scales=()) -> int:
    """Write ``saved`` to ``path`` (whole or not at all: a file beside it, then renamed); the
    bytes written. ``lora_scales``: the LoRA scales its cache was decoded with, one per adapter of
    ``ident``."""
    parts = [{"media": {"id": p.id, "n_tokens": p.n_tokens, "n_pos": p.n_pos}} if isinstance(p, CachedMedia)
             else {"text": np.asarray(p).tolist()} for p in saved.parts]
    header = json.dumps({
        "version": VERSION, "model": ident.model, "projector": ident.projector, "cache": ident.cache,
        "lora": {"adapters": list(ident.lora), "scales": [float(x) for x in lora_scales]},
        "draft_positions": saved.draft_positions, "n_rows": saved.positions().n_rows, "parts": parts,
        "memory": {"size": len(saved.memory), "sha256": hashlib.sha256(saved.memory).hexdigest()},
    }, separators=(",", ":")).encode()
    path = Path(path)
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        with open(partial, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, len(header)))
            f.write(header)
            f.write(saved.memory)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return _PREFIX.size + len(header) + len(saved.memory)


#: Room a slot's memory may take besides its KV cache rows: recurrent state, llama.cpp's own fields.
MEMORY_SLACK = 256 * 2**20


def memory_bound(model: str | os.PathLike, *, n_ctx: int, type_k: str, type_v: str) -> int:
    """The most memory a slot of ``n_ctx`` rows of ``model`` can hold once serialized: twice its KV
    cache's rows at their largest (``gguf.memory.kv_bytes_per_row``: every layer as attention with
    the most KV heads, none windowed), and ``MEMORY_SLACK``."""
    from pyllama_spec.gguf.memory import kv_bytes_per_row

    return 2 * n_ctx * kv_bytes_per_row(model, type_k=type_k, type_v=type_v) + MEMORY_SLACK


def read(path: str | os.PathLike, ident: SlotIdentity, *, n_ctx: int,
         n_vocab: int, max_memory: int | None = None) -> tuple[SavedSequence, int, tuple[float, ...]]:
    """The SavedSequence in ``path``, the bytes read and the LoRA scales its cache was decoded
    with, checked against this engine (``ident``), a slot of ``n_ctx`` rows and a vocabulary of
    ``n_vocab`` tokens, and memory of at most ``max_memory`` bytes (``memory_bound``) before it is
    read; SlotFileError otherwise (FileNotFoundError / OSError when it cannot be read at all)."""
    max_header = 4096 + 64 * n_ctx  # a header for n_ctx rows of tokens or media items is well below
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise SlotFileError("the file is too short to be a slot file")
        magic, n_header = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise SlotFileError("the file is not a slot file saved by pyllama-spec")
        if n_header > min(max_header, size - _PREFIX.size):
            raise SlotFileError(f"its header claims {n_header} bytes (the file has {size}; a slot of {n_ctx} rows "
                                f"needs at most {max_header})")
        try:
            header = json.loads(f.read(n_header))
        except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
            raise SlotFileError("its header is not valid JSON (the file is damaged)") from None
        parts, mode, memory = _check_header(header, ident, n_ctx=n_ctx, n_vocab=n_vocab)
        if max_memory is not None and memory["size"] > max_memory:
            raise SlotFileError(f"its memory claims {memory['size']} bytes; a slot of {n_ctx} rows of this model "
                                f"holds at most {max_memory}")
        scales = _check_lora(header, ident)
        if size - _PREFIX.size - n_header != memory["size"]:
            raise SlotFileError(f"it holds {size - _PREFIX.size - n_header} bytes of memory, its header says "
                                f"{memory['size']} (the file is truncated or damaged)")
        data = f.read(memory["size"])
    if hashlib.sha256(data).hexdigest() != memory["sha256"]:
        raise SlotFileError("its memory does not match its checksum (the file is damaged)")
    return SavedSequence(tuple(parts), mode, data), size, scales


def _open_regular(path: str | os.PathLike):
    """``path`` opened for reading if it is a regular file, and not through a symbolic link. Opened
    without blocking, so that a FIFO planted in the slot folder cannot hold the reading thread until
    something writes to it; anything but a regular file is a SlotFileError."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise SlotFileError("it is a symbolic link, not a slot file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SlotFileError("it is not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _check_lora(header: dict, ident: SlotIdentity) -> tuple[float, ...]:
    """The LoRA scales of the saved cache: its adapters must be this server's (the cache was
    decoded through them)."""
    lora = header.get("lora")
    if not (isinstance(lora, dict) and isinstance(lora.get("adapters"), list) and isinstance(lora.get("scales"), list)
            and len(lora["scales"]) == len(lora["adapters"])
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lora["scales"])):
        raise SlotFileError("its LoRA description is missing or malformed")
    if lora["adapters"] != list(ident.lora):
        raise SlotFileError(f"it was saved with {len(lora['adapters'])} LoRA adapter(s) that are not this server's "
                            f"{len(ident.lora)} (--lora)")
    return tuple(float(x) for x in lora["scales"])


def _check_header(header, ident: SlotIdentity, *, n_ctx: int, n_vocab: int) -> tuple[list, str, dict]:
    """The header's parts, position mode and memory description, each checked."""
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise SlotFileError(f"its format is not version {VERSION} of pyllama-spec's slot files")
    if header.get("model") != ident.model:
        raise SlotFileError("it was saved from another model file (its size or first bytes differ from this "
                            "server's -m)")
    if header.get("cache") != ident.cache:
        raise SlotFileError(f"it was saved with a KV cache of {_show(header.get('cache'))}, this server has "
                            f"{ident.cache} (-ctk / -ctv)")
    mode = header.get("draft_positions")
    if mode not in DRAFT_POSITION_MODES:
        raise SlotFileError(f"its position mode {_show(mode)} is not 'target' or 'sequential'")
    raw = header.get("parts")
    if not isinstance(raw, list):
        raise SlotFileError("its parts are not a list")
    parts, rows = [], 0
    for k, part in enumerate(raw):
        parts.append(_check_part(part, k, n_vocab))
        rows += parts[-1].n_tokens if isinstance(parts[-1], CachedMedia) else len(parts[-1])
    if rows != header.get("n_rows"):
        raise SlotFileError(f"its parts hold {rows} rows, its header says {_show(header.get('n_rows'))}")
    if rows + 1 > n_ctx:  # llama-server's words
        raise SlotFileError(f"Restored prompt does not fit in the slot context ({rows} rows + 1, the slot has {n_ctx})")
    if any(isinstance(p, CachedMedia) for p in parts) and header.get("projector") != ident.projector:
        raise SlotFileError("its cache holds media encoded by another projector than this server's --mmproj")
    memory = header.get("memory")
    if not (isinstance(memory, dict) and _int(memory.get("size")) and memory["size"] > 0
            and isinstance(memory.get("sha256"), str)):
        raise SlotFileError("its memory description is missing or malformed")
    return parts, mode, memory


def _check_part(part, k: int, n_vocab: int):
    if isinstance(part, dict) and len(part) == 1 and isinstance(part.get("text"), list) and part["text"]:
        tokens = part["text"]
        if not all(_int(t) and 0 <= t < n_vocab for t in tokens):
            raise SlotFileError(f"part {k} holds tokens outside this model's vocabulary of {n_vocab}")
        return np.asarray(tokens, dtype=np.int32)
    media = part.get("media") if isinstance(part, dict) and len(part) == 1 else None
    if isinstance(media, dict) and set(media) == {"id", "n_tokens", "n_pos"} \
            and (media["id"] is None or isinstance(media["id"], str)) \
            and _int(media["n_tokens"]) and _int(media["n_pos"]) and 1 <= media["n_pos"] <= media["n_tokens"]:
        return CachedMedia(media["id"], media["n_tokens"], media["n_pos"])
    raise SlotFileError(f"part {k} is neither text tokens nor a media item")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(v) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
