"""How the build shows itself: its messages, the progress of a compile, and the log of each step."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from .common import BuildError


def _say(msg: str) -> None:
    """A build message on standard error, and on the terminal when standard error is not one: pip
    keeps a build's output to itself (the user saw only "Building editable ... still running")."""
    line = f"[pyllama-spec build] {msg}"
    print(line, file=sys.stderr, flush=True)
    if not sys.stderr.isatty():
        _to_terminal(line)


def _to_terminal(line: str) -> None:
    try:
        with open("/dev/tty", "w", encoding="utf-8", errors="replace") as tty:  # the controlling terminal
            tty.write(line + "\n")
    except (OSError, ValueError):
        pass  # none (CI, a daemon): standard error is all there is


_STEP = re.compile(r"^\[(\d+)/(\d+)\]|^\[\s*(\d+)%\]")


def _run_logged(cmd: list[str], log_path: Path, what: str, progress: bool = False) -> str:
    """Run a build step, keep its whole output in a log, show progress, explain failure;
    returns the step's output."""
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        reporter = _Progress(what) if progress else None
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            m = _STEP.match(line)
            if reporter and m:
                if m.group(1):
                    reporter.update(int(m.group(1)), int(m.group(2)), line.strip())
                else:
                    reporter.update(int(m.group(3)), 100, line.strip())
        rc = proc.wait()
        if reporter:
            reporter.close()
    if rc != 0:
        tail = "".join(Path(log_path).read_text().splitlines(keepends=True)[-40:])
        raise BuildError(f"{what} failed (exit {rc}); full log: {log_path}\n{tail}")
    output = Path(log_path).read_text(errors="replace")
    if progress and _nothing_to_do(output):
        _say(f"{what}: up to date")
    else:
        _say(f"{what}: done in {time.monotonic() - started:.0f} s")
    return output


class _Progress:
    """A rich progress bar on a terminal; a line every 10% otherwise."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.last_decile = -1
        self.bar = None
        if sys.stderr.isatty():
            try:
                from rich.progress import (
                    BarColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                )

                self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                    TextColumn("[dim]{task.fields[step]}"), transient=False)
                self.bar.start()
                self.task = self.bar.add_task(what, total=None, step="")
            except ImportError:
                self.bar = None

    def update(self, done: int, total: int, line: str) -> None:
        if self.bar is not None:
            step = line.split()[-1][-60:] if line.split() else ""
            self.bar.update(self.task, completed=done, total=total, step=step)
            return
        decile = done * 10 // max(total, 1)
        if decile != self.last_decile:
            self.last_decile = decile
            _say(f"{self.what}: {done}/{total}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _nothing_to_do(build_output: str) -> bool:
    """Whether a `cmake --build` compiled no source file (ninja and make both say "Building ...
    object" for each; a folder configured again may still relink or refresh library links)."""
    return not re.search(r"Building (C|CXX|CUDA|HIP|ASM) object", build_output)
