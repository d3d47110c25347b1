"""The compiled cffi module and its shared libraries: loading them, routing native log
messages (llama, ggml, mtmd) into Python ``logging`` under ``pyllama_spec.native``, and
carrying Ctrl-C and callback exceptions out of native calls.

``ffi`` and ``lib`` are the only names the binding layer imports from here; what the build
and the backends say about themselves is ``bindings.native_info``.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import _signal  # getsignal without signal's enum conversion: it runs before every decode
import signal
import threading

from pyllama_spec.errors import NativeLibraryError, set_native_problem_source

SHIM_ABI_VERSION = 5

try:
    from pyllama_spec._native._pyllama_cffi import ffi, lib  # type: ignore[import-not-found]
except ImportError as e:  # pragma: no cover - exercised only without a build
    raise NativeLibraryError(
        "pyllama-spec's native part is not built or cannot be loaded "
        f"({e}). From a source checkout run `python build.py` (add --cuda/--rocm/--vulkan/--metal for a GPU "
        "backend), or reinstall with `pip install .`"
    ) from e

if lib.pyllama_shim_abi_version() != SHIM_ABI_VERSION:  # pragma: no cover
    raise NativeLibraryError(
        f"native shim ABI {lib.pyllama_shim_abi_version()} does not match the Python side ({SHIM_ABI_VERSION}): "
        "rebuild with `python build.py`")

# ----------------------------------------------------------------------------- logging

native_logger = logging.getLogger("pyllama_spec.native")
native_logger.addHandler(logging.NullHandler())  # a library does not print; errors reach the caller
# The last warnings/errors llama.cpp logged: attached to exceptions, so that a failure
# says what the native side said about it.
_recent_problems: collections.deque[str] = collections.deque(maxlen=6)
_LEVELS = {
    lib.GGML_LOG_LEVEL_DEBUG: logging.DEBUG,
    lib.GGML_LOG_LEVEL_INFO: logging.INFO,
    lib.GGML_LOG_LEVEL_WARN: logging.WARNING,
    lib.GGML_LOG_LEVEL_ERROR: logging.ERROR,
}
# Native logs arrive in pieces (a message, then GGML_LOG_LEVEL_CONT pieces); whole lines are
# emitted. The line being assembled is kept as a list of pieces, so assembling costs the size of
# its pieces (mtmd logs a whole prompt at debug level: megabytes, one line per prompt line).
_pending: dict = {"level": logging.INFO, "pieces": [], "size": 0}
#: A logged line longer than this is cut (only a prompt echoed at debug level gets near it).
MAX_LOG_LINE = 16 * 1024


# ----------------------------------------------------------------------------- callbacks and Ctrl-C
# cffi swallows an exception that escapes a callback (printing "Exception ignored from cffi
# callback"). A KeyboardInterrupt lands in whatever Python code runs next, which during a
# native call is a callback: each callback's onerror keeps the exception here, and
# raise_carried() raises it once the native call has returned.
_carried = threading.local()


def carry(exc_type, exc_value, traceback) -> None:  # noqa: ARG001 - cffi's onerror signature
    """onerror handler of every callback: keep the exception for the caller of the native call."""
    if getattr(_carried, "exc", None) is None:
        _carried.exc = exc_value


def raise_carried() -> None:
    """Raise what a callback of the native call that just returned could not raise itself."""
    exc = getattr(_carried, "exc", None)
    if exc is not None:
        _carried.exc = None
        raise exc


def arm_interrupts() -> None:
    """Before a decode: let Ctrl-C stop it between graph nodes (see pyllama_abort_requested).

    Only where Python's own SIGINT handler is in place on the main thread: a program that
    installed its own handler (or ignores SIGINT) decides for itself what Ctrl-C means.
    """
    if threading.get_ident() == threading.main_thread().ident:
        lib.pyllama_interrupt_hook(_signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    lib.pyllama_interrupt_take()  # forget a Ctrl-C that arrived before this call


def interrupted_during_call() -> bool:
    """After a decode returned "aborted": raise the KeyboardInterrupt behind it, if it was Ctrl-C.

    Python's handler already ran (the hook chains to it), so the interrupt is pending;
    PyErr_CheckSignals delivers it now rather than at some later bytecode. Returns True
    when the abort was Ctrl-C but Python did not raise (another thread, another handler).
    """
    if not lib.pyllama_interrupt_take():
        return False
    raise_carried()
    if threading.current_thread() is threading.main_thread():
        ctypes.pythonapi.PyErr_CheckSignals()  # raises KeyboardInterrupt when one is pending
    return True


def abort_after(n_checks: int) -> None:
    """Fault injection for tests: the n-th abort check from now stops a decode (0: off).

    Decodes check between graph nodes, on every context, so a sweep over n lands failures
    anywhere: in a target or draft decode, in a later ubatch of a batch, in an image slice.
    """
    lib.pyllama_abort_after(n_checks)


@ffi.def_extern(onerror=carry)
def pyllama_log_callback(level, text, user_data):  # noqa: ARG001 - signature fixed by ggml
    """Runs on every native log call, inside native code: O(size of the piece), nothing decoded
    for a level nobody listens to."""
    if text == ffi.NULL:
        return
    if level != lib.GGML_LOG_LEVEL_CONT:
        _flush_pending()  # a new message: an unterminated previous line ends here
        _pending["level"] = _LEVELS.get(level, logging.INFO)
    current = _pending["level"]
    if current < logging.WARNING and not native_logger.isEnabledFor(current):
        return  # neither logged nor kept for errors: skip without reading the text
    piece = ffi.string(text).decode("utf-8", errors="replace")
    if "\n" not in piece:
        _add_to_line(piece)
        return
    first, *middle, rest = piece.split("\n")
    _add_to_line(first)
    _flush_pending()
    for line in middle:
        _emit(current, line)
    _add_to_line(rest)


def _add_to_line(piece: str) -> None:
    room = MAX_LOG_LINE - _pending["size"]
    if piece and room > 0:
        _pending["pieces"].append(piece[:room])
        _pending["size"] += min(len(piece), room)


def _flush_pending() -> None:
    if _pending["pieces"]:
        line = "".join(_pending["pieces"])
        _pending["pieces"], _pending["size"] = [], 0
        _emit(_pending["level"], line)


def _emit(level: int, line: str) -> None:
    if not line:
        return
    if len(line) > MAX_LOG_LINE:
        line = line[:MAX_LOG_LINE] + f" ... ({len(line) - MAX_LOG_LINE} more characters)"
    if level >= logging.WARNING:
        _recent_problems.append(line.strip())
    if native_logger.isEnabledFor(level):
        native_logger.log(level, line)


def echo_log_to_stderr() -> None:
    """Print llama.cpp's log, INFO and above, to standard error (llama-cpp-python's ``verbose=True``);
    once, however often it is asked."""
    if not any(getattr(h, "pyllama_verbose", False) for h in native_logger.handlers):
        handler = logging.StreamHandler()
        handler.pyllama_verbose = True
        handler.setFormatter(logging.Formatter("%(message)s"))
        native_logger.addHandler(handler)
    if native_logger.getEffectiveLevel() > logging.INFO:
        native_logger.setLevel(logging.INFO)


def take_native_problems() -> list[str]:
    """The native warnings/errors logged since the last call (and forget them)."""
    out = list(_recent_problems)
    _recent_problems.clear()
    return out


def _install_logging() -> None:
    set_native_problem_source(take_native_problems)
    lib.llama_log_set(lib.pyllama_log_callback, ffi.NULL)
    lib.mtmd_helper_log_set(lib.pyllama_log_callback, ffi.NULL)


_install_logging()
lib.llama_backend_init()
