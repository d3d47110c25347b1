"""What every step of the native build shares: the folders it works in, and the error it raises."""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = Path(__file__).resolve().parents[1]
NATIVE_DIR = PACKAGE_DIR / "_native"
PATCHES_DIR = PROJECT_ROOT / "patches"


class BuildError(RuntimeError):
    """The native build cannot go on; the message says what is missing and how to get it."""


def cache_root() -> Path:
    """Where sources and builds are cached: $PYLLAMA_SPEC_CACHE or ~/.cache/pyllama-spec."""
    env = os.environ.get("PYLLAMA_SPEC_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pyllama-spec"


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p
