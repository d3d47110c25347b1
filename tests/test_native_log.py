"""The native log callback: whole lines into Python logging, in time linear in what is logged.

mtmd logs the whole prompt at debug level; the callback runs inside that native call (on the
server's slot loop thread), so its cost must not grow faster than the text, and nothing at all
should be paid for a level nobody listens to.
"""

from __future__ import annotations

import logging
import time

import pytest

from pyllama_spec import _native
from pyllama_spec._native import ffi, lib

DEBUG, WARN, CONT = lib.GGML_LOG_LEVEL_DEBUG, lib.GGML_LOG_LEVEL_WARN, lib.GGML_LOG_LEVEL_CONT


def _log(level: int, text: str) -> None:
    lib.pyllama_log_callback(level, ffi.new("char[]", text.encode()), ffi.NULL)


@pytest.fixture
def native_log(caplog):
    caplog.set_level(logging.DEBUG, logger="pyllama_spec.native")
    _log(lib.GGML_LOG_LEVEL_INFO, "\n")  # start from a clean line
    caplog.clear()
    return caplog


def test_a_prompt_of_many_lines_logged_at_debug_costs_next_to_nothing_when_debug_is_off():
    assert not logging.getLogger("pyllama_spec.native").isEnabledFor(logging.DEBUG)
    text = "x = 1\n" * 350_000  # 2 MiB: 7 s with a split per line, as mtmd's prompt echo did
    # CPU seconds of this thread (the callback runs on it): the work, which load from other
    # processes does not stretch as it stretches the wall clock
    start = time.thread_time()
    _log(DEBUG, text)
    assert time.thread_time() - start < 0.5


def test_with_debug_on_the_same_prompt_is_logged_line_by_line_in_linear_time(native_log):
    text = "x = 1\n" * 100_000
    start = time.perf_counter()
    _log(DEBUG, text)
    elapsed = time.perf_counter() - start
    assert len(native_log.records) == 100_000
    assert {r.getMessage() for r in native_log.records} == {"x = 1"}
    assert elapsed < 10  # about 1 s: logging's own cost per record; a quadratic split took minutes


def test_pieces_of_one_message_are_joined_into_whole_lines(native_log):
    _log(WARN, "the draft ")
    _log(CONT, "does not fit\nsecond ")
    _log(CONT, "line\n")
    assert [r.getMessage() for r in native_log.records] == ["the draft does not fit", "second line"]
    assert all(r.levelno == logging.WARNING for r in native_log.records)
    assert _native.take_native_problems()[-2:] == ["the draft does not fit", "second line"]


def test_a_new_message_ends_an_unterminated_line(native_log):
    _log(WARN, "no newline here")
    _log(lib.GGML_LOG_LEVEL_ERROR, "an error\n")
    assert [(r.levelno, r.getMessage()) for r in native_log.records] == [
        (logging.WARNING, "no newline here"), (logging.ERROR, "an error")]


def test_an_endless_line_in_many_pieces_is_cut_and_costs_linear_time(native_log):
    start = time.perf_counter()
    _log(DEBUG, "")
    for _ in range(20_000):
        _log(CONT, "y" * 1024)  # 20 MiB without a newline
    _log(CONT, "\n")
    assert time.perf_counter() - start < 5
    (record,) = native_log.records
    assert len(record.getMessage()) == _native.MAX_LOG_LINE
