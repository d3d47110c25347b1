"""The cffi module, compiled in API mode against the real headers (once per build and interpreter,
kept in the build folder), and its installation with the shared libraries beside it."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from .backends import RPC_SERVER
from .common import NATIVE_DIR, _mkdir
from .record import NativeBuild, _write_build_summary, write_build_record


CFFI_MODULE = "pyllama_spec._native._pyllama_cffi"
DECL_FILES = ("ggml.h", "llama.h", "mtmd.h", "shim.h")  # order matters: later files use earlier types


def read_declarations() -> str:
    decl_dir = NATIVE_DIR / "decl"
    return "\n".join((decl_dir / name).read_text() for name in DECL_FILES)


def make_ffibuilder(build: NativeBuild, rpath: str):
    """The cffi builder in API mode: the C compiler sees our declarations and the real headers."""
    from cffi import FFI

    ffi = FFI()
    ffi.cdef(read_declarations())
    ffi.set_source(
        CFFI_MODULE,
        '#include "llama.h"\n#include "mtmd.h"\n#include "mtmd-helper.h"\n#include "pyllama_shim.h"\n',
        include_dirs=[str(p) for p in build.include_dirs()],
        library_dirs=[str(build.lib_dir)],
        libraries=["llama", "mtmd", "ggml", "ggml-base", "pyllama_shim"],
        extra_link_args=[f"-Wl,-rpath,{rpath}"],
    )
    return ffi


PACKAGED_LIBS = ("libllama.", "libllama-common.", "libmtmd.", "libggml", "libpyllama_shim.")


def shared_libraries(lib_dir: Path) -> dict[str, Path]:
    """{file name to install: real file}: one copy per library, under the name the loader
    asks for (libfoo.so.N, the SONAME; libfoo.so for unversioned ones)."""
    pattern = "*.dylib" if sys.platform == "darwin" else "*.so*"
    by_real: dict[Path, list[str]] = {}
    for p in sorted(lib_dir.glob(pattern)):
        by_real.setdefault(p.resolve(), []).append(p.name)
    chosen: dict[str, Path] = {}
    for real, names in by_real.items():
        if not any(n.startswith(PACKAGED_LIBS) for n in names):
            continue  # e.g. llama-server's own libraries, built for benchmarks only
        soname = [n for n in names if re.search(r"\.so\.\d+$", n)]
        for name in (soname or [min(names, key=len)]):
            chosen[name] = real
    return chosen


def install_native(build: NativeBuild, package_native_dir: Path) -> Path:
    """Copy the libraries next to the package and compile the cffi module there."""
    lib_out = package_native_dir / "lib"
    if lib_out.exists():
        shutil.rmtree(lib_out)
    lib_out.mkdir(parents=True)
    for name, real in shared_libraries(build.lib_dir).items():
        shutil.copy2(real, lib_out / name)
    if build.rpc and (build.lib_dir / RPC_SERVER).is_file():
        # beside the libraries it loads through its $ORIGIN rpath; `pyllama-spec rpc-server` runs it
        shutil.copy2(build.lib_dir / RPC_SERVER, lib_out / RPC_SERVER)
    rpath = "@loader_path/lib" if sys.platform == "darwin" else "$ORIGIN/lib"
    built, compiled = _cffi_module(build, rpath)
    for old in package_native_dir.glob("_pyllama_cffi*"):
        old.unlink()
    target = package_native_dir / built.name
    shutil.copy2(built, target)
    _write_build_summary(build.build_dir, cffi="compiled" if compiled else "cached")
    write_build_record(build, package_native_dir / "build_record.json")
    return target


def _cffi_module(build: NativeBuild, rpath: str) -> tuple[Path, bool]:
    """The compiled cffi module for this build and this Python, compiled once and kept in the
    build folder (keyed by the declarations, headers' folders, rpath and the interpreter's ABI),
    so that reinstalling compiles nothing. Returns (its path, whether it was compiled now)."""
    import sysconfig

    import cffi

    digest = hashlib.sha256()
    for part in (read_declarations(), rpath, cffi.__version__, *map(str, build.include_dirs()), str(build.lib_dir),
                 sysconfig.get_config_var("EXT_SUFFIX") or "", sys.version, build.key):
        digest.update(part.encode() + b"\0")
    cached_dir = build.build_dir / "cffi" / digest.hexdigest()[:16]
    found = sorted(cached_dir.glob("_pyllama_cffi*")) if cached_dir.is_dir() else []
    if found:
        return found[0], False
    ffi = make_ffibuilder(build, rpath)
    with tempfile.TemporaryDirectory() as tmp:
        built = Path(ffi.compile(tmpdir=tmp, verbose=False))
        staging = Path(tempfile.mkdtemp(dir=_mkdir(cached_dir.parent)))
        shutil.copy2(built, staging / built.name)
        try:
            os.replace(staging, cached_dir)  # atomic: a concurrent build's copy is as good
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return cached_dir / built.name, True
