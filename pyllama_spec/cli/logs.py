"""``serve``'s logging flags, llama-server's: ``-v`` / ``--verbose``, ``-lv N`` / ``--verbosity N``,
``--log-file FILE``, ``--log-disable``, through Python's logging.

llama.cpp's levels map onto Python's: 0 output only (CRITICAL), 1 errors, 2 warnings, 3 info (the
default), 4 and up debug; ``-v`` is debug. What is logged: the ``pyllama_spec`` loggers (the
server's, its request log at debug: server/request_log.py) and, at debug, llama.cpp's own log
(which, as llama-server's, says what loading does; below debug only its errors). Lines go to standard error, and with ``--log-file`` to that file too.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable

_LEVELS = {0: logging.CRITICAL, 1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO}
FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


def level_of(verbosity: int, verbose: bool) -> int:
    """The Python level for llama.cpp's verbosity (``-lv``) and ``-v``."""
    return logging.DEBUG if verbose or verbosity >= 4 else _LEVELS.get(max(verbosity, 0), logging.CRITICAL)


def configure(*, verbosity: int = 3, verbose: bool = False, log_file: str | None = None,
              disable: bool = False) -> tuple[int, Callable[[], None]]:
    """Send the package's log where the flags say; returns the level (for uvicorn's own log) and a
    function that puts the loggers back as they were (``serve`` calls it when it returns, so that a
    program that ran it in-process keeps its own logging). OSError (with the path) when the log file
    cannot be opened."""
    root = logging.getLogger("pyllama_spec")
    native = logging.getLogger("pyllama_spec.native")
    before = (root.propagate, root.level, native.level)
    added: list[logging.Handler] = []

    def undo() -> None:
        for h in added:
            root.removeHandler(h)
            h.close()
        root.propagate, _, _ = before
        root.setLevel(before[1])
        native.setLevel(before[2])

    root.propagate = False  # the handlers here, not the application's root logger's
    if disable:
        root.setLevel(logging.CRITICAL + 1)
        return logging.CRITICAL + 1, undo
    level = level_of(verbosity, verbose)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
    for h in handlers:
        h.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(h)
        added.append(h)
    root.setLevel(level)
    # llama.cpp's own log only when asked for everything (its warnings come a line at a time, some
    # of them continuations); its errors always (a failure also raises, with them attached)
    native.setLevel(logging.DEBUG if level <= logging.DEBUG else logging.ERROR)
    return level, undo
