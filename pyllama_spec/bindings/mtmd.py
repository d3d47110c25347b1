"""Pythonic wrappers over libmtmd: Projector, Bitmap, Chunks, Chunk.

A Projector (the mmproj file, bound to a target Model) turns a prompt with media
markers and bitmaps into Chunks: text chunks (token ids) and media chunks (rows to
encode). A media chunk costs ``n_tokens`` cache rows but only ``n_pos`` positions;
for an M-RoPE image every row shares one section-0 position.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import threading
from pathlib import Path
from typing import Callable, Sequence, Union

import numpy as np

from pyllama_spec._native import (
    arm_interrupts,
    carry,
    ffi,
    interrupted_during_call,
    lib,
    raise_carried,
)
from pyllama_spec.bindings.handle import NativeHandle
from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.model import Model, check_gguf_file
from pyllama_spec.errors import (
    ImageError,
    NativeCallError,
    ProjectorError,
    check_decode,
    check_encode,
    check_tokenize,
    forget_native_problems,
    with_native_log,
)

MEDIA_MARKER = ffi.string(lib.mtmd_default_marker()).decode()

ImageInput = Union[str, os.PathLike, bytes, "PIL.Image.Image", np.ndarray]  # noqa: F821

_CHUNK_TYPES = {lib.MTMD_INPUT_CHUNK_TYPE_TEXT: "text", lib.MTMD_INPUT_CHUNK_TYPE_IMAGE: "image",
                lib.MTMD_INPUT_CHUNK_TYPE_AUDIO: "audio"}


class Bitmap(NativeHandle):
    """An RGB image ready for mtmd. Build it with ``Bitmap.load(path | bytes | PIL image | array)``."""

    _what = "bitmap"

    def __init__(self, rgb: np.ndarray, *, source: str = "array") -> None:
        arr = np.ascontiguousarray(rgb, dtype=np.uint8)
        if arr.ndim != 3 or arr.shape[2] != 3 or arr.shape[0] == 0 or arr.shape[1] == 0:
            raise ImageError(f"an image must be RGB [height, width, 3], got shape {arr.shape} ({source})")
        self.height, self.width = int(arr.shape[0]), int(arr.shape[1])
        self.source = source
        ptr = lib.mtmd_bitmap_init(self.width, self.height, ffi.from_buffer("unsigned char[]", arr))
        if ptr == ffi.NULL:
            raise NativeCallError("mtmd_bitmap_init", None, f"{self.width}x{self.height} ({source})")
        self._ptr = ptr
        # The prompt cache recognises an image by this id, so it covers everything that changes
        # the image's rows: the pixels and the shape (a 224x112 and a 112x224 picture of one
        # colour have the same bytes). The projector is fixed for an engine's lifetime.
        self.id = image_id(arr)
        lib.mtmd_bitmap_set_id(ptr, self.id.encode())

    def _free(self, ptr) -> None:
        lib.mtmd_bitmap_free(ptr)

    @classmethod
    def load(cls, image: ImageInput) -> "Bitmap":
        """From a path, the bytes of an image file, a PIL image or an RGB uint8 array."""
        if isinstance(image, np.ndarray):
            return cls(image)
        from PIL import Image, UnidentifiedImageError

        from pyllama_spec.bindings.image_convert import to_rgb8

        source = "image"
        try:
            if isinstance(image, (str, os.PathLike)):
                source = str(image)
                if not Path(image).exists():
                    raise ImageError(f"image not found: {image}")
                with Image.open(image) as im:
                    rgb = to_rgb8(im)  # scales 16-bit and float modes (convert clips them)
            elif isinstance(image, (bytes, bytearray, memoryview)):
                source = f"{len(image)} bytes"
                with Image.open(io.BytesIO(bytes(image))) as im:
                    rgb = to_rgb8(im)  # scales 16-bit and float modes (convert clips them)
            elif isinstance(image, Image.Image):
                source = f"PIL image {image.size[0]}x{image.size[1]}"
                rgb = to_rgb8(image)
            else:
                raise ImageError(f"unsupported image input of type {type(image).__name__}: "
                                 "give a path, bytes, a PIL image or an RGB array")
        except ImageError:
            raise
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
            raise ImageError(f"cannot read image {source}: {e}") from e
        return cls(rgb, source=source)


def image_id(rgb: np.ndarray) -> str:
    """Content id of an RGB uint8 image: its shape and its pixels."""
    h = hashlib.sha256(f"rgb8 {rgb.shape[0]}x{rgb.shape[1]}x{rgb.shape[2]}\n".encode())
    h.update(np.ascontiguousarray(rgb).data)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class EmbeddingBatch:
    """One slice of media rows just decoded into the target (mtmd's post-decode view).

    ``embd`` float32 [n_rows, n_embd] and ``positions`` int32 [n_pos, n_rows]
    (section-major, as the context was given them) are views valid during the callback.
    """

    embd: np.ndarray
    positions: np.ndarray
    seq_id: int

    @property
    def n_rows(self) -> int:
        return self.embd.shape[0]


class Chunk:
    """One chunk of a tokenized prompt: text tokens, or a media item (image/audio). A view into Chunks."""

    #: The same media item as a vision draft model's own projector cuts it (a Chunk of that
    #: projector's, set by the engine that pairs the two tokenizations); None otherwise.
    draft: "Chunk | None" = None

    def __init__(self, owner: "Chunks", ptr) -> None:
        self._owner = owner  # keeps the native list alive
        self._ptr = ptr

    @property
    def projector(self) -> "Projector | None":
        """The projector whose tokenize made this chunk (it encodes it)."""
        return self._owner.projector

    @property
    def type(self) -> str:
        return _CHUNK_TYPES.get(lib.mtmd_input_chunk_get_type(self._ptr), "unknown")

    @property
    def is_text(self) -> bool:
        return self.type == "text"

    @property
    def n_tokens(self) -> int:
        """Rows this chunk occupies in the KV cache."""
        return int(lib.mtmd_input_chunk_get_n_tokens(self._ptr))

    @property
    def n_pos(self) -> int:
        """Positions this chunk advances the sequence by (< n_tokens for an M-RoPE image)."""
        return int(lib.mtmd_input_chunk_get_n_pos(self._ptr))

    @property
    def id(self) -> str | None:
        p = lib.mtmd_input_chunk_get_id(self._ptr)
        return None if p == ffi.NULL else ffi.string(p).decode()

    @property
    def tokens(self) -> np.ndarray:
        """Token ids of a text chunk (int32)."""
        if not self.is_text:
            raise ValueError(f"a {self.type} chunk has no token ids")
        n = ffi.new("size_t *")
        ptr = lib.mtmd_input_chunk_get_tokens_text(self._ptr, n)
        return np.frombuffer(ffi.buffer(ptr, n[0] * 4), dtype=np.int32).copy()

    def decoder_positions(self, pos0: int) -> np.ndarray:
        """M-RoPE decoder positions (t, x, y, z) of an image's rows when it starts at pos0: uint32 [n_tokens, 4]."""
        img = lib.mtmd_input_chunk_get_tokens_image(self._ptr)
        if img == ffi.NULL:
            raise ValueError(f"a {self.type} chunk has no image positions")
        n = int(lib.mtmd_image_tokens_get_n_tokens(img))
        out = ffi.new("struct mtmd_decoder_pos[]", n)
        lib.mtmd_helper_image_get_decoder_pos(img, pos0, out)
        return np.frombuffer(ffi.buffer(out, n * 16), dtype=np.uint32).reshape(n, 4).copy()


class Chunks(NativeHandle):
    """A tokenized multimodal prompt: a sequence of Chunk."""

    _what = "chunks"

    def __init__(self, ptr, projector: "Projector | None" = None) -> None:
        self._ptr = ptr
        self.projector = projector  # the projector that cut them (its encode reads their media chunks)

    def _free(self, ptr) -> None:
        lib.mtmd_input_chunks_free(ptr)

    def __len__(self) -> int:
        return int(lib.mtmd_input_chunks_size(self.ptr))

    def __getitem__(self, i: int) -> Chunk:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        return Chunk(self, lib.mtmd_input_chunks_get(self.ptr, i % n))

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def n_tokens(self) -> int:
        """Cache rows the whole prompt needs."""
        return int(lib.mtmd_helper_get_n_tokens(self.ptr))

    @property
    def n_pos(self) -> int:
        """Positions the whole prompt spans."""
        return int(lib.mtmd_helper_get_n_pos(self.ptr))


class _DecodeCallbackState:
    def __init__(self, ctx: Context, on_batch: Callable[[EmbeddingBatch], None] | None, n_embd: int) -> None:
        self.ctx = ctx
        self.on_batch = on_batch
        self.n_embd = n_embd
        self.error: BaseException | None = None


def _stop_decoding(*exc) -> int:
    carry(*exc)  # an exception raised before the body's own try (e.g. Ctrl-C at its first line)
    return 1


@ffi.def_extern(onerror=_stop_decoding)
def pyllama_post_decode_callback(view, user_data):
    state: _DecodeCallbackState = ffi.from_handle(user_data)
    try:
        n, n_embd, n_pos = view.n_tokens, view.n_embd, view.n_pos
        embd = np.frombuffer(ffi.buffer(view.embd, n * n_embd * 4), dtype=np.float32).reshape(n, n_embd)
        pos = np.frombuffer(ffi.buffer(view.pos, n * n_pos * 4), dtype=np.int32).reshape(n_pos, n)
        state.ctx.model.check_remote()  # a server lost in this slice: stop before anyone reads its outputs
        state.ctx.last_decode_rows = n  # the context's output buffers now hold this slice
        if state.on_batch is not None:
            state.on_batch(EmbeddingBatch(embd, pos, int(view.seq_id)))
        return 0
    except BaseException as e:  # noqa: BLE001 - carried back across the native frame
        state.error = e
        return 1


class Projector(NativeHandle):
    """A multimodal projector (mmproj GGUF) bound to its target text model.

    >>> with Projector("mmproj.gguf", target) as proj:       # doctest: +SKIP
    ...     chunks = proj.tokenize(f"look: {MEDIA_MARKER}", [Bitmap.load("cat.png")])
    """

    _what = "projector"

    def __init__(self, path: str | os.PathLike, model: Model, *, use_gpu: bool = True, n_threads: int | None = None,
                 flash_attn: bool | None = False, warmup: bool = False, role: str = "target") -> None:
        self.path = check_gguf_file(path, "mmproj")
        self.model = model
        self.role = role  # whose projector: "target", or "draft" (a vision draft model's own)
        params = lib.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.print_timings = False
        params.n_threads = n_threads or max(1, os.cpu_count() or 2)
        params.warmup = warmup
        params.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_AUTO if flash_attn is None else
                                  lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else
                                  lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        forget_native_problems()
        ptr = lib.mtmd_init_from_file(str(self.path).encode(), model.ptr, params)
        try:
            raise_carried()
        except BaseException:
            if ptr != ffi.NULL:
                lib.mtmd_free(ptr)
            raise
        if ptr == ffi.NULL:
            raise ProjectorError(with_native_log(
                f"mtmd_init_from_file could not load the projector {self.path} for the {model.arch} {role} "
                f"{model.path.name} (not an mmproj, corrupt, or its projection size does not match the "
                f"{role}'s input width n_embd_inp {model.n_embd_inp})"))
        self._ptr = ptr
        # where its encoder runs: a GPU when asked for and the build has one (encode_media decides by it)
        self.on_gpu = bool(use_gpu) and bool(lib.llama_supports_gpu_offload())
        model.dependents.add(self)  # freed before the model it reads from
        # Ctrl-C stops an encode between graph nodes (patches/0002; a no-op on an unpatched tree).
        lib.pyllama_mtmd_set_abort_callback(ptr)
        self.n_encode_calls = 0  # counted so that callers (and tests) can see cache reuse
        # One encode at a time: mtmd's context has one output buffer, and two encodes at once on it
        # (a slot loop's encoder thread and an embedding on the loop's thread) abort in clip.cpp.
        self._encoding = threading.Lock()

    def _free(self, ptr) -> None:
        lib.mtmd_free(ptr)

    @property
    def ptr(self):
        self.model.ptr  # a projector reads its model's vocabulary: refuse once the model is closed
        return super().ptr

    @property
    def uses_mrope(self) -> bool:
        return bool(lib.mtmd_decode_use_mrope(self.ptr))

    @property
    def supports_vision(self) -> bool:
        return bool(lib.mtmd_support_vision(self.ptr))

    @property
    def supports_audio(self) -> bool:
        return bool(lib.mtmd_support_audio(self.ptr))

    def tokenize(self, text: str, bitmaps: Sequence[Bitmap] = (), *, add_special: bool = True,
                 parse_special: bool = True) -> Chunks:
        """Split a prompt with one MEDIA_MARKER per bitmap into chunks."""
        n_markers = text.count(MEDIA_MARKER)
        if n_markers != len(bitmaps):
            raise ValueError(f"the prompt has {n_markers} media marker(s) {MEDIA_MARKER!r} "
                             f"but {len(bitmaps)} image(s) were given")
        data = text.encode("utf-8")
        buf = ffi.new("char[]", data)
        inp = ffi.new("mtmd_input_text *", {"text": buf, "text_len": len(data), "add_special": add_special,
                                            "parse_special": parse_special})
        arr = ffi.new("mtmd_bitmap *[]", [b.ptr for b in bitmaps] or [ffi.NULL])
        chunks = lib.mtmd_input_chunks_init()
        rc = lib.mtmd_tokenize(self.ptr, chunks, inp, arr, len(bitmaps))
        try:
            raise_carried()
        except BaseException:
            lib.mtmd_input_chunks_free(chunks)
            raise
        if rc != 0:
            lib.mtmd_input_chunks_free(chunks)
        check_tokenize(rc)
        return Chunks(chunks, self)

    def encode(self, chunk: Chunk) -> np.ndarray:
        """Run the vision encoder on a media chunk: float32 [n_tokens, n_embd] (a copy)."""
        if chunk.is_text:
            raise ValueError("only media chunks are encoded")
        with self._encoding:
            arm_interrupts()
            rc = lib.mtmd_encode_chunk(self.ptr, chunk._ptr)
            self.n_encode_calls += 1
            raise_carried()
            ctrl_c = rc != 0 and interrupted_during_call()
            check_encode(rc, chunk_type=chunk.type, n_rows=chunk.n_tokens, interrupted=ctrl_c)
            ptr = lib.mtmd_get_output_embd(self.ptr)
            n = chunk.n_tokens * self.model.n_embd_inp
            return np.frombuffer(ffi.buffer(ptr, n * 4), dtype=np.float32).reshape(chunk.n_tokens, -1).copy()

    def media_positions(self, chunk: Chunk, pos0: int) -> np.ndarray:
        """Decoder positions of a media chunk's rows when it starts at pos0, as mtmd's decode helper
        sets them: int32 [n_tokens, n_pos] (row-major, as ``Batch.add_embeddings`` takes them).

        M-RoPE image: the sections (t, y, x, z) from mtmd; M-RoPE audio: pos0 + i in all four;
        otherwise one section, pos0 + i. Decoding slices of the chunk in turn with these rows
        is what the helper does in one call; doing it slice by slice lets a scheduler run
        other sequences' steps between two slices.
        """
        n = chunk.n_tokens
        if not self.uses_mrope:
            return (pos0 + np.arange(n, dtype=np.int32)).reshape(n, 1)
        if chunk.type == "image":
            d = chunk.decoder_positions(pos0).astype(np.int32)  # columns t, x, y, z
            return np.ascontiguousarray(d[:, [0, 2, 1, 3]])
        return np.repeat((pos0 + np.arange(n, dtype=np.int32))[:, None], 4, axis=1)

    def uses_non_causal(self, chunk: Chunk) -> bool:
        """Whether the target attends non-causally over this media chunk's rows (e.g. Gemma 3 images)."""
        return bool(lib.mtmd_decode_use_non_causal(self.ptr, chunk._ptr))

    def decode_media(self, ctx: Context, chunk: Chunk, embd: np.ndarray, pos0: int, *, n_batch: int,
                     seq_id: int = 0, on_batch: Callable[[EmbeddingBatch], None] | None = None) -> int:
        """Decode an encoded media chunk into ctx in slices of n_batch rows, from position pos0.

        ``on_batch`` sees every slice right after the target decoded it (where a drafter
        injects features). Returns the sequence's next position (pos0 + chunk.n_pos).
        An exception raised by on_batch stops the chunk and propagates unchanged.
        """
        e = np.ascontiguousarray(embd, dtype=np.float32)
        if e.shape[0] != chunk.n_tokens:
            raise ValueError(f"embeddings have {e.shape[0]} rows, the chunk {chunk.n_tokens}")
        state = _DecodeCallbackState(ctx, on_batch, e.shape[1])
        handle = ffi.new_handle(state)
        new_pos = ffi.new("llama_pos *")
        forget_native_problems()
        ctx.last_decode_rows = 0
        ctx.model.check_remote()
        arm_interrupts()
        rc = lib.mtmd_helper_decode_image_chunk(
            self.ptr, ctx.ptr, chunk._ptr, ffi.from_buffer("float[]", e), pos0, seq_id, n_batch, new_pos,
            lib.pyllama_post_decode_callback, handle)
        raise_carried()
        ctx.model.check_remote()  # a server lost during the chunk explains the failure best
        if state.error is not None:
            raise state.error
        ctrl_c = rc != 0 and interrupted_during_call()
        check_decode(rc, "mtmd_helper_decode_image_chunk", role=ctx.role, n_rows=min(n_batch, chunk.n_tokens),
                     offset=pos0, detail=f"failed to decode {chunk.type} chunk of {chunk.n_tokens} rows"
                     + (" (interrupted: Ctrl-C)" if ctrl_c else ""))
        return int(new_pos[0])
