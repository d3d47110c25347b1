"""The CMake build of llama, mtmd, ggml and our shim: the tools it runs, the cached copy of our
CMake project, the build folder keyed by (source, patches, backend, flags), and configure + build
in it (incremental: configured again only when its arguments or tools changed)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .backends import RPC_SERVER, BuildOptions, _extra_cmake_args, backend_cmake_args, feature_cmake_args, rpc_wanted
from .common import PROJECT_ROOT, BuildError, _mkdir, cache_root
from .progress import _nothing_to_do, _run_logged, _say
from .record import NativeBuild, _write_build_summary
from .source import PIN_UPSTREAM_COMMIT, Source, pinned_source, user_source


def project_snapshot() -> Path:
    """A copy of our CMake project (CMakeLists.txt + native/) in the cache, keyed by its content.

    CMake ties a build folder to one source folder; building from a stable copy lets every
    checkout of the same code (CI clones in new folders, worktrees) share one cached build.
    """
    files = [PROJECT_ROOT / "CMakeLists.txt", *sorted((PROJECT_ROOT / "native").rglob("*"))]
    digest = hashlib.sha256()
    for f in files:
        if f.is_file():
            digest.update(str(f.relative_to(PROJECT_ROOT)).encode() + b"\0" + f.read_bytes())
    snap = cache_root() / "project" / digest.hexdigest()[:12]
    if not (snap / ".complete").exists():
        tmp = Path(tempfile.mkdtemp(dir=snap.parent if snap.parent.exists() else _mkdir(snap.parent)))
        for f in files:
            if f.is_file():
                dest = tmp / f.relative_to(PROJECT_ROOT)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, dest)
        (tmp / ".complete").write_text("")
        if snap.exists():
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, snap)
    return snap


def build_key(source: Source, opts: BuildOptions, cmake_args: list[str], project: Path) -> str:
    payload = json.dumps({"source": source.identity, "project": project.name, "backend": opts.backend,
                          "type": opts.build_type, "cmake": cmake_args, "machine": platform.machine()},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class BuildTools:
    """The cmake and ninja a build folder is configured and built with, as absolute paths.

    A build folder remembers the tools that configured it (CMakeCache.txt: CMAKE_COMMAND,
    CMAKE_MAKE_PROGRAM). Inside ``pip install`` they live in pip's temporary build environment,
    which pip deletes afterwards, so every configure names them explicitly and a folder whose
    tools changed (moved, or gone) is configured again with the ones found now.
    """

    cmake: str
    ninja: str | None  # None: CMake's default generator (Unix Makefiles)

    @classmethod
    def find(cls) -> "BuildTools":
        """The first cmake (>= 3.21) and ninja on PATH, preferring ones outside pip's temporary
        build environment: a build folder configured with those never needs configuring again."""
        cmake = _find_tool("cmake", usable=_cmake_is_recent)
        if cmake is None:
            raise BuildError("cmake (>= 3.21) is needed: pip install cmake, or apt-get install cmake")
        ninja = _find_tool("ninja")
        return cls(cmake, ninja)

    @property
    def generator(self) -> str:
        return "Ninja" if self.ninja else "Unix Makefiles"

    def configure_args(self) -> list[str]:
        args = [self.cmake, "-G", self.generator]
        if self.ninja:
            args.append(f"-DCMAKE_MAKE_PROGRAM={self.ninja}")
        return args


def _find_tool(name: str, usable=lambda path: True) -> str | None:
    found = []
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        cand = shutil.which(name, path=folder) if folder else None
        if cand and str(Path(cand).absolute()) not in found and usable(cand):
            found.append(str(Path(cand).absolute()))
    lasting = [c for c in found if "pip-build-env-" not in c]
    return (lasting or found or [None])[0]


def _cmake_is_recent(cmake: str) -> bool:
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    version = re.search(r"cmake version (\d+)\.(\d+)", out)
    return bool(version) and (int(version.group(1)), int(version.group(2))) >= (3, 21)


def _cached_generator(cache: Path) -> str | None:
    found = re.search(r"^CMAKE_GENERATOR:INTERNAL=(.*)$", cache.read_text(errors="replace"), re.MULTILINE)
    return found.group(1).strip() if found else None


def _cache_dir(cache: Path) -> str | None:
    """The directory a CMakeCache.txt was made in (CMAKE_CACHEFILE_DIR)."""
    found = re.search(r"^CMAKE_CACHEFILE_DIR:INTERNAL=(.*)$", cache.read_text(errors="replace"), re.MULTILINE)
    return found.group(1).strip() if found else None


def _same_dir(recorded: str, build_dir: Path) -> bool:
    """The folder a CMakeCache.txt records is ``build_dir`` (as CMake compares them: the same folder,
    also through a symbolic link)."""
    try:
        return os.path.samefile(recorded, build_dir)
    except OSError:  # the recorded folder is gone: the cache was moved
        return False


def configure_and_build(tools: BuildTools, project: Path, build_dir: Path, cmake_args: list[str],
                        targets: list[str], jobs: int) -> dict[str, bool]:
    """Configure ``build_dir`` for ``project`` when needed, then build ``targets`` in it.

    Configures again when the arguments or the tools differ from the last configure (the
    stamp ``configure-args.json``), keeping what was compiled: ninja compiles nothing whose
    command line is unchanged. Returns {target: whether any source file was compiled}.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    configure = [*tools.configure_args(), "-S", str(project), "-B", str(build_dir), *cmake_args]
    stamp, cache = build_dir / "configure-args.json", build_dir / "CMakeCache.txt"
    previous = json.loads(stamp.read_text()) if stamp.exists() else None
    made_at = _cache_dir(cache) if cache.exists() else None
    if made_at is not None and not _same_dir(made_at, build_dir):
        # a cache folder copied or moved: CMake refuses a CMakeCache.txt made in another directory
        _say(f"the build folder was made at {made_at}, not here; configuring it again")
        shutil.rmtree(build_dir)
        build_dir.mkdir(parents=True)
        previous = None
    if previous != configure or not cache.exists():
        if cache.exists() and _cached_generator(cache) != tools.generator:
            # CMake refuses to switch a folder's generator: start this folder again
            _say(f"the build folder was made with another generator ({_cached_generator(cache)}); rebuilding it")
            shutil.rmtree(build_dir)
            build_dir.mkdir(parents=True)
        elif previous is not None and previous[:3] != configure[:3]:
            _say(f"the tools that configured {build_dir} changed or are gone; configuring again")
        else:
            _say(f"configuring in {build_dir}")
        stamp.unlink(missing_ok=True)  # a configure that fails halfway leaves no stamp
        _run_logged(configure, build_dir / "configure.log", "configure")
        stamp.write_text(json.dumps(configure))
    compiled = {}
    for target in targets:
        log = _run_logged([tools.cmake, "--build", str(build_dir), "--target", target, "-j", str(jobs)],
                          build_dir / f"build-{target}.log", f"compile {target}", progress=True)
        compiled[target] = not _nothing_to_do(log)
    return compiled


def build_native(opts: BuildOptions) -> NativeBuild:
    """Configure and build llama + mtmd + the shim (incremental inside a cached build dir)."""
    tools = BuildTools.find()
    source = user_source(opts.llama_cpp) if opts.llama_cpp else pinned_source()
    cmake_args = backend_cmake_args(opts) + feature_cmake_args(opts) + _extra_cmake_args(opts)
    project = project_snapshot()
    key = build_key(source, opts, cmake_args, project)
    build_dir = cache_root() / "build" / f"{opts.backend}-{key}"
    configure = [f"-DCMAKE_BUILD_TYPE={opts.build_type}", f"-DLLAMA_CPP_DIR={source.path}"]
    if source.origin == "pinned":
        configure.append(f"-DLLAMA_BUILD_COMMIT={PIN_UPSTREAM_COMMIT}")
    # llama-server's targets are always configured (not built unless asked for), so that
    # `--tools` reuses the same build folder and compiled libraries.
    configure += ["-DPYLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
    configure += cmake_args
    targets = (["pyllama_native"] + ([RPC_SERVER] if rpc_wanted(opts) else [])
               + (["llama-server"] if opts.tools else []))
    jobs = opts.jobs or os.cpu_count() or 2
    if not (build_dir / "configure-args.json").exists():  # a first build: say what it takes
        what = f"llama.cpp {PIN_UPSTREAM_COMMIT[:12]}" if source.origin == "pinned" else f"llama.cpp from {source.path}"
        _say(f"compiling {what} for {opts.backend}: {first_build_minutes(opts.backend, jobs)} with {jobs} jobs "
             f"(later builds reuse it); logs in {build_dir}")
    compiled = configure_and_build(tools, project, build_dir, configure, targets, jobs)
    _write_build_summary(build_dir, compiled=compiled)
    return NativeBuild(build_dir, build_dir / "bin", source, opts.backend, tuple(cmake_args), key,
                       rpc=rpc_wanted(opts))


def first_build_minutes(backend: str, jobs: int) -> str:
    """About how long a first build takes: a CPU build measured 8-16 minutes with 2 jobs on a busy
    2-core machine and 3-4 on an idle one; GPU backends compile their kernels besides."""
    low, high = max(1, round(6 / jobs)), max(2, round(32 / jobs))
    if backend in ("cuda", "rocm"):
        low, high = low * 3, high * 3
    return f"about {low}-{high} minutes"


def find_llama_server() -> Path | None:
    """The most recently built llama-server in the build cache (``build.py --tools`` makes one)."""
    found = sorted((cache_root() / "build").glob("*/bin/llama-server"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None
