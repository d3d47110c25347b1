"""NativeHandle: the one owner of a native pointer (freed exactly once, on close, on leaving a
``with`` block, or when collected). Every wrapper class (Model, Context, Batch, Projector,
Bitmap, Chunks, Sampler) is one."""

from __future__ import annotations

from pyllama_spec._native import ffi
from pyllama_spec.errors import ClosedError


class NativeHandle:
    """Owns one native pointer; subclasses say how to free it in ``_free``."""

    _ptr = ffi.NULL
    _what = "object"

    def _free(self, ptr) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        return self._ptr == ffi.NULL

    @property
    def ptr(self):
        """The native pointer; raises ClosedError after close(). For the wrapper layer only."""
        if self._ptr == ffi.NULL:
            raise ClosedError(f"{self._what} is closed")
        return self._ptr

    def close(self) -> None:
        ptr, self._ptr = self._ptr, ffi.NULL
        if ptr != ffi.NULL:
            self._free(ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # Interpreter shutdown may already have torn down the module globals.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer must never raise
            pass
