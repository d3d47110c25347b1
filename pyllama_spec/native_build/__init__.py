"""Build the native part: a pinned llama.cpp + libmtmd, our C shim, and the cffi module.

This package uses the standard library only (rich for progress when it is installed,
cffi to compile the binding) and imports nothing from ``pyllama_spec`` outside itself,
so that ``build.py`` and the package build (``setup.py``, through ``build.py``'s
``load_native_build``) can load it by path before ``pyllama_spec`` itself is importable:
its modules import each other relatively, and work both as ``pyllama_spec.native_build``
and as ``pyllama_spec_native_build``.

Steps, each cached:
1. the llama.cpp source: the pinned ``llama-cpp-python`` sdist from PyPI (verified by
   sha256, its ``vendor/llama.cpp`` extracted and patched) or the user's own checkout;
2. CMake configure + build of ``llama``, ``mtmd``, ggml and ``pyllama_shim`` in a build
   folder keyed by (source, patches, backend, flags), outside the repository;
3. the cffi module, compiled in API mode against the real headers, and the shared
   libraries copied beside it, with a ``build_record.json`` that ``doctor`` reads.

Modules, each importing only those listed above it:
- ``common``: the folders (project, package, patches, cache) and ``BuildError``;
- ``progress``: the build's messages, progress bar and the log of each command it runs;
- ``source``: step 1 (``Source``, the pin ``PIN_*``, ``pinned_source``, ``user_source``);
- ``backends``: ``BuildOptions``, the backends' toolchain checks and their CMake flags;
- ``record``: a build's result ``NativeBuild``, ``build_record.json`` (with the DFlash-capable
  architectures read from the built source) and the build folder's ``last-build.json``;
- ``cmake``: step 2 (``BuildTools``, ``build_key``, ``configure_and_build``,
  ``build_native``, ``find_llama_server``);
- ``cffi_module``: step 3 (``install_native``);
- this file: ``build_in_place`` (all three steps), the command line of ``build.py``
  (``parse_args``, ``main``), and the names the rest of the project uses.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .backends import (
    BACKENDS,
    RPC_SERVER,
    BuildOptions,
    backend_cmake_args,
    backend_from_cmake_args,
    feature_cmake_args,
    rpc_wanted,
)
from .cffi_module import (
    CFFI_MODULE,
    DECL_FILES,
    PACKAGED_LIBS,
    install_native,
    make_ffibuilder,
    read_declarations,
    shared_libraries,
)
from .cmake import (
    BuildTools,
    build_key,
    build_native,
    configure_and_build,
    find_llama_server,
    project_snapshot,
)
from .common import NATIVE_DIR, PACKAGE_DIR, PATCHES_DIR, PROJECT_ROOT, BuildError, cache_root
from .progress import _say
from .record import NativeBuild, dflash_capable_archs, write_build_record
from .source import (
    PIN_PACKAGE,
    PIN_SHA256,
    PIN_UPSTREAM_COMMIT,
    PIN_UPSTREAM_DATE,
    PIN_VERSION,
    SDIST_NAME,
    Source,
    fetch_pinned_sdist,
    patch_files,
    pinned_source,
    user_source,
)

__all__ = [
    "BACKENDS", "CFFI_MODULE", "DECL_FILES", "NATIVE_DIR", "PACKAGED_LIBS", "PACKAGE_DIR", "PATCHES_DIR",
    "PIN_PACKAGE", "PIN_SHA256", "PIN_UPSTREAM_COMMIT", "PIN_UPSTREAM_DATE", "PIN_VERSION", "PROJECT_ROOT",
    "RPC_SERVER", "SDIST_NAME",
    "BuildError", "BuildOptions", "BuildTools", "NativeBuild", "Source",
    "backend_cmake_args", "backend_from_cmake_args", "build_in_place", "build_key", "build_native", "cache_root",
    "configure_and_build", "dflash_capable_archs", "feature_cmake_args", "fetch_pinned_sdist", "find_llama_server",
    "install_native", "main", "make_ffibuilder", "parse_args", "patch_files", "pinned_source", "project_snapshot",
    "read_declarations", "rpc_wanted", "shared_libraries", "user_source", "write_build_record",
]


def build_in_place(opts: BuildOptions, package_native_dir: Path = NATIVE_DIR) -> Path:
    started = time.monotonic()
    build = build_native(opts)
    module = install_native(build, package_native_dir)
    _say(f"native part ready: {module.name} ({opts.backend}, {time.monotonic() - started:.0f} s)")
    return module


def parse_args(argv: list[str] | None = None) -> BuildOptions:
    ap = argparse.ArgumentParser(prog="build.py", description="Build pyllama-spec's native part in place.")
    group = ap.add_mutually_exclusive_group()
    for b in BACKENDS[1:]:
        group.add_argument(f"--{b}", dest="backend", action="store_const", const=b, help=f"build the {b} backend")
    ap.add_argument("--cuda-arch", help="CMAKE_CUDA_ARCHITECTURES, e.g. 90 or '86;90'")
    ap.add_argument("--cublas-dir", help="folder with libcublas.so* when it is not inside the CUDA toolkit "
                                         "(also $PYLLAMA_CUBLAS_DIR)")
    ap.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR"),
                    help="use this llama.cpp checkout instead of the pinned source (also $LLAMA_CPP_DIR)")
    ap.add_argument("--cmake-arg", action="append", default=[], help="extra CMake argument (repeatable; "
                                                                       "$CMAKE_ARGS is read too)")
    ap.add_argument("--debug", action="store_true", help="CMAKE_BUILD_TYPE=Debug")
    ap.add_argument("-j", "--jobs", type=int, help="parallel compile jobs (default: all cores)")
    ap.add_argument("--tools", action="store_true", help="also build llama-server from the same source and flags")
    ap.add_argument("--rpc", action=argparse.BooleanOptionalAction, default=True,
                    help="ggml's RPC backend (remote devices) and ggml-rpc-server (default: on; --no-rpc "
                         "leaves them out, as -DGGML_RPC=OFF in CMAKE_ARGS does)")
    ns = ap.parse_args(argv)
    return BuildOptions(backend=ns.backend or "cpu", cuda_arch=ns.cuda_arch, cublas_dir=ns.cublas_dir,
                        llama_cpp=ns.llama_cpp, cmake_args=tuple(ns.cmake_arg),
                        build_type="Debug" if ns.debug else "Release", jobs=ns.jobs, tools=ns.tools,
                        rpc=ns.rpc)


def main(argv: list[str] | None = None) -> int:
    try:
        build_in_place(parse_args(argv))
    except BuildError as e:
        print(f"build failed: {e}", file=sys.stderr)
        return 1
    return 0
