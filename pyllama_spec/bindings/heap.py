"""The C heap the native library allocates from: giving back to the OS what closing native objects freed."""

from __future__ import annotations

import ctypes


def give_back_freed_pages() -> None:
    """glibc's ``malloc_trim(0)``: glibc keeps freed pages in its arenas (one per thread that allocated),
    so a process that closed its model would otherwise stay as large. Nothing where there is no glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # (TypeError: CDLL(None) where there is no such call)
        pass
