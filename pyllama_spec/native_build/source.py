"""The llama.cpp source to build: the pinned ``llama-cpp-python`` sdist (downloaded with pip,
verified by sha256, its ``vendor/llama.cpp`` extracted and patched) or the user's own checkout."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .common import PATCHES_DIR, BuildError, cache_root
from .progress import _say


# The pinned llama.cpp: llama-cpp-python 0.3.36 vendors ggml-org/llama.cpp@0c1e57098
# (tree of 2026-10-01), which has DFlash, mtmd, llama_batch_ext/llama_process and
# src/llama-ext.h.
PIN_PACKAGE = "llama-cpp-python"
PIN_VERSION = "0.3.36"
PIN_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PIN_UPSTREAM_COMMIT = "0c1e57098"
PIN_UPSTREAM_DATE = "2026-10-01"
SDIST_NAME = f"llama_cpp_python-{PIN_VERSION}.tar.gz"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class Source:
    """A llama.cpp source tree ready to build."""

    path: Path
    origin: str  # "pinned" or "user"
    identity: str  # what the cache key uses: the pin's sha256, or the user's path + git head
    patches: tuple[str, ...]  # names of the patches applied to it


def patch_files() -> list[Path]:
    return sorted(PATCHES_DIR.glob("*.patch")) if PATCHES_DIR.is_dir() else []


def _patch_digest(patches: list[Path]) -> str:
    digest = hashlib.sha256()
    for p in patches:
        digest.update(p.name.encode() + b"\0" + p.read_bytes())
    return digest.hexdigest()


def _pip_command() -> tuple[list[str], dict[str, str]]:
    """pip, runnable from inside a package build too.

    pip's isolated build environment hides the interpreter's own site-packages (through
    PYTHONPATH and its own variables), so pip itself is not importable there: run it with
    those variables removed.
    """
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME") and not k.startswith("PIP_BUILD")
           and k not in ("PIP_REQ_TRACKER", "PIP_NO_BUILD_ISOLATION")}
    for python in {getattr(sys, "_base_executable", sys.executable), sys.executable}:
        if subprocess.run([python, "-c", "import pip"], env=env, capture_output=True).returncode == 0:
            return [python, "-m", "pip"], env
    for name in ("pip3", "pip"):
        found = shutil.which(name)
        if found and subprocess.run([found, "--version"], env=env, capture_output=True).returncode == 0:
            return [found], env
    raise BuildError("pip is needed to fetch the pinned llama.cpp source and was not found; "
                     "install pip, or pass --llama-cpp DIR with a llama.cpp checkout")


def fetch_pinned_sdist() -> Path:
    """The pinned sdist, downloaded once with pip and verified by its sha256."""
    downloads = cache_root() / "downloads"
    target = downloads / SDIST_NAME
    if target.exists() and _sha256(target) == PIN_SHA256:
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    _say(f"downloading {PIN_PACKAGE}=={PIN_VERSION} (llama.cpp {PIN_UPSTREAM_COMMIT}) with pip ...")
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        pip, env = _pip_command()
        # --no-binary for the pin alone: pip prepares the sdist's metadata in an isolated build
        # environment, and ":all:" would compile its build requirements (cmake) from source too.
        cmd = pip + ["download", "--no-deps", "--no-binary", PIN_PACKAGE, "-d", tmp, f"{PIN_PACKAGE}=={PIN_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        got = Path(tmp) / SDIST_NAME
        if not got.exists():
            raise BuildError(f"could not download {PIN_PACKAGE}=={PIN_VERSION} from the package index "
                             f"(or pass --llama-cpp DIR with a llama.cpp checkout):\n"
                             f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        digest = _sha256(got)
        if digest != PIN_SHA256:
            raise BuildError(f"{SDIST_NAME} has sha256 {digest}, expected {PIN_SHA256}: refusing to build it")
        os.replace(got, target)
    return target


def _apply_patches(tree: Path, patches: list[Path]) -> None:
    """Apply each patch once; a patch already applied is recognised and skipped."""
    for p in patches:
        if _run_quiet(["git", "apply", "--reverse", "--check", str(p)], cwd=tree) == 0:
            continue  # already applied
        if _run_quiet(["git", "apply", "--check", str(p)], cwd=tree) != 0:
            raise BuildError(f"patch {p.name} does not apply to {tree}")
        if _run_quiet(["git", "apply", str(p)], cwd=tree) != 0:
            raise BuildError(f"patch {p.name} failed to apply to {tree}")


def _run_quiet(cmd: list[str], cwd: Path) -> int:
    # GIT_CEILING_DIRECTORIES: never let git look above the tree for a repository.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(Path(cwd).resolve().parent))
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, env=env).returncode
    except FileNotFoundError:
        raise BuildError(f"'{cmd[0]}' is needed to apply patches/ and was not found") from None


def pinned_source() -> Source:
    """The pinned tree, extracted and patched under the cache (once per patch set)."""
    patches = patch_files()
    key = f"{PIN_SHA256[:12]}-p{_patch_digest(patches)[:10]}"
    tree = cache_root() / "src" / f"llama.cpp-{key}"
    identity = f"pinned:{PIN_SHA256}:{_patch_digest(patches)}"
    names = tuple(p.name for p in patches)
    if (tree / ".pyllama-ready").exists():
        return Source(tree, "pinned", identity, names)
    sdist = fetch_pinned_sdist()
    _say(f"extracting vendor/llama.cpp from {sdist.name} ...")
    prefix = f"llama_cpp_python-{PIN_VERSION}/vendor/llama.cpp/"
    tree.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tree.parent) as tmp:
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix):]
            kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp, members=[m for m in members if m.name], **kwargs)
        # The sdist keeps vendor/llama.cpp's submodule pointer (a .git file naming a folder
        # that is not there); it would make git (patches, build-info) fail in this tree.
        stray = Path(tmp) / ".git"
        if stray.is_file():
            stray.unlink()
        _apply_patches(Path(tmp), patches)
        (Path(tmp) / ".pyllama-ready").write_text(identity + "\n")
        if tree.exists():
            shutil.rmtree(tree)
        os.replace(tmp, tree)
        os.makedirs(tmp)  # so that TemporaryDirectory's cleanup finds something to remove
    return Source(tree, "pinned", identity, names)


def user_source(path: str | os.PathLike) -> Source:
    """A user's own llama.cpp checkout, used as it is (our patches are not applied to it)."""
    tree = Path(path).expanduser().resolve()
    for needed in ("include/llama.h", "src/llama-ext.h", "tools/mtmd/mtmd-helper.h"):
        if not (tree / needed).exists():
            raise BuildError(f"{tree} is not a usable llama.cpp checkout: {needed} is missing "
                             "(DFlash needs a tree with src/llama-ext.h and tools/mtmd)")
    head = ""
    if (tree / ".git").exists():
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()
    stamp = max((tree / f).stat().st_mtime for f in ("include/llama.h", "src/llama-ext.h"))
    return Source(tree, "user", f"user:{tree}:{head}:{stamp}", ())
