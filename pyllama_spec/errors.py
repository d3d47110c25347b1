"""The exceptions pyllama-spec raises.

Each also inherits the builtin a caller would reach for (``FileNotFoundError``,
``ValueError``, ``RuntimeError``), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class PyllamaError(Exception):
    """Base class of every pyllama-spec error."""


class NativeLibraryError(PyllamaError, ImportError):
    """The native part is missing or does not match this Python code."""


class ModelFileError(PyllamaError, OSError):
    """A GGUF file is missing, unreadable, corrupt, or not loadable by this build."""


class ProjectorError(PyllamaError, ValueError):
    """The multimodal projector (mmproj) cannot be used with this target."""


class ImageError(PyllamaError, ValueError):
    """An image could not be read or turned into a bitmap."""


class IncompatibleModelsError(PyllamaError, ValueError):
    """A draft does not fit its target, or a combination would abort natively."""


class ChatTemplateError(PyllamaError, ValueError):
    """The chat template (the model's, or the one given) cannot be used: llama-server refuses to
    start with it too."""


class ContextOverflowError(PyllamaError, ValueError):
    """The prompt (or prompt + generation) does not fit in the context: ``n_prompt_tokens`` rows (at
    least; None when not counted) where a slot holds ``n_ctx`` (llama-server's error fields)."""

    def __init__(self, message: str, *, n_prompt_tokens: int | None = None, n_ctx: int | None = None) -> None:
        super().__init__(message)
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx


class ContextFullError(PyllamaError, RuntimeError):
    """The cache cells the slots share (``kv_unified``) are all taken: this generation could not go on.
    Its message says "Context size has been exceeded", as llama-server's does."""


class TrainingLengthWarning(UserWarning):
    """A context longer than the target was trained for (llama.cpp's "possible training context
    overflow"): its positions past the training length were never trained, and text there may degrade."""


class ClosedError(PyllamaError, ValueError):
    """An object was used after close()."""


class EngineBusyError(PyllamaError, RuntimeError):
    """The engine cannot take this request now: it was used from inside its own running
    generation (e.g. from a progress callback), or its slots' waiting queue is full."""


class GenerationCancelledError(PyllamaError, RuntimeError):
    """A suspended stream was resumed after a newer generation (or close) took its engine over.

    Its cache and positions were rewritten, so it cannot go on; start a new generation.
    """


class InsufficientMemoryError(PyllamaError, MemoryError):
    """The configuration needs more memory than the device has free (estimated before loading)."""


class RemoteDeviceError(PyllamaError, ConnectionError):
    """An RPC server (ggml-rpc-server) cannot be reached, answers wrongly, or its connection was lost.

    ``endpoint`` is the server's host:port.
    """

    def __init__(self, message: str, endpoint: str | None = None) -> None:
        self.endpoint = endpoint
        super().__init__(message)


class NativeCallError(PyllamaError, RuntimeError):
    """A native call failed; the message names the call and its arguments."""

    def __init__(self, call: str, rc: int | None = None, detail: str = "") -> None:
        self.call = call
        self.rc = rc
        self.native_log = _native_problems()
        msg = f"{call} failed" + (f" (rc = {rc})" if rc is not None else "") + (f": {detail}" if detail else "")
        if self.native_log:
            msg += "\nllama.cpp said: " + " | ".join(self.native_log[-3:])
        super().__init__(msg)


# Where the native warnings/errors logged since the last failure come from: _native sets it
# when it loads (errors.py imports nothing native, so it can describe a missing native part).
_native_problem_source = None


def set_native_problem_source(take) -> None:
    """Called once by ``_native``: ``take()`` returns (and forgets) the native problems logged."""
    global _native_problem_source
    _native_problem_source = take


def _native_problems() -> list[str]:
    return _native_problem_source() if _native_problem_source is not None else []


# What llama_decode / llama_process return codes mean (include/llama.h).
_DECODE_RC = {
    1: "no memory slot for the batch (the KV cache is full or cannot free cells at these positions)",
    2: "aborted",
    -1: "invalid input batch",
}

# What llama_batch_ext_add_token / _add_embd return when they refuse a row (the shim's
# pyllama_batch_ext_add_tokens / _add_embds pass them on, and add -4 for a refused position).
_BATCH_ADD_RC = {-1: "batch is full", -2: "invalid token or embedding size", -3: "invalid sequence id",
                 -4: "invalid position"}

# What mtmd_tokenize returns (tools/mtmd/mtmd.h).
_TOKENIZE_RC = {1: "number of bitmaps does not match the markers", 2: "image preprocessing failed"}


class DecodeError(NativeCallError):
    """llama_decode/llama_process failed on one context.

    Attributes name the context (``role``: "target" or "draft"), the number of rows
    in the batch, the offset (first position) and the return code.
    """

    def __init__(self, call: str, rc: int, *, role: str, n_rows: int, offset: int | None = None,
                 detail: str = "") -> None:
        self.role = role
        self.n_rows = n_rows
        self.offset = offset
        meaning = _DECODE_RC.get(rc, "fatal error" if rc < -1 else "warning")
        where = f"{role} context, batch of {n_rows} rows" + (f" at position {offset}" if offset is not None else "")
        super().__init__(call, rc, f"{where}: {meaning}" + (f"; {detail}" if detail else ""))


class KVMemoryError(NativeCallError):
    """A KV-cache / recurrent-state operation could not be done (e.g. a partial rollback)."""


def forget_native_problems() -> None:
    """Start a native operation with a clean slate, so its error names only its own problems."""
    _native_problems()


def with_native_log(message: str) -> str:
    """Append what llama.cpp logged about the failure just seen, if anything."""
    said = _native_problems()
    return message + ("\nllama.cpp said: " + " | ".join(said[-3:]) if said else "")


def check_decode(rc: int, call: str, *, role: str, n_rows: int, offset: int | None = None,
                 detail: str = "") -> None:
    """The one gate for decode return codes: 0 passes, anything else raises DecodeError."""
    if rc != 0:
        raise DecodeError(call, rc, role=role, n_rows=n_rows, offset=offset, detail=detail)


def check_batch_add(rc: int, *, n_rows: int, batch_rows: int, role: str) -> None:
    """The gate for adding rows to a batch: rc >= 0 passes, a negative rc raises NativeCallError.

    ``n_rows``: the rows being added; ``batch_rows``: those the batch held before. The caller
    clears the batch before calling with a negative rc (the message says it was cleared).
    """
    if rc < 0:
        raise NativeCallError("llama_batch_ext_add", rc,
                              f"{_BATCH_ADD_RC.get(rc, 'error')} while adding {n_rows} rows to a batch of "
                              f"{batch_rows} ({role} context); the batch was cleared")


def check_state(n_bytes: int, call: str, *, role: str, seq_id: int, size: int) -> None:
    """The gate for llama_state_seq_get_data / _set_data: the bytes written or read pass, 0 (what
    llama.cpp returns when it cannot save or restore a sequence) raises KVMemoryError."""
    if n_bytes == 0:
        raise KVMemoryError(call, 0, f"{role} context, sequence {seq_id}, {size} bytes of state: "
                                     "llama.cpp could not " + ("save" if "get" in call else "restore") + " it")


def check_set_lora(rc: int, *, role: str, n_adapters: int) -> None:
    """The gate for llama_set_adapters_lora: 0 passes, anything else raises NativeCallError."""
    if rc != 0:
        raise NativeCallError("llama_set_adapters_lora", rc, f"{role} context, {n_adapters} adapters")


def check_tokenize(rc: int) -> None:
    """The gate for mtmd_tokenize: 0 passes, anything else raises NativeCallError."""
    if rc != 0:
        raise NativeCallError("mtmd_tokenize", rc, _TOKENIZE_RC.get(rc, "tokenization failed"))


def check_encode(rc: int, *, chunk_type: str, n_rows: int, interrupted: bool = False) -> None:
    """The gate for mtmd_encode_chunk: 0 passes, anything else raises NativeCallError naming the
    chunk, or saying Ctrl-C stopped it (``interrupted``)."""
    if rc != 0:
        raise NativeCallError("mtmd_encode_chunk", rc,
                              "interrupted (Ctrl-C)" if interrupted else f"{chunk_type} chunk of {n_rows} rows")
