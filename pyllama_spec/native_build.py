"""Build the native part: a pinned llama.cpp + libmtmd, our C shim, and the cffi module.

This module uses the standard library only (rich for progress when it is installed,
cffi to compile the binding), so that ``build.py`` and the package build can load
it by path before ``pyllama_spec`` itself is importable.

Steps, each cached:
1. the llama.cpp source: the pinned ``llama-cpp-python`` sdist from PyPI (verified by
   sha256, its ``vendor/llama.cpp`` extracted and patched) or the user's own checkout;
2. CMake configure + build of ``llama``, ``mtmd``, ggml and ``pyllama_shim`` in a build
   folder keyed by (source, patches, backend, flags), outside the repository;
3. the cffi module, compiled in API mode against the real headers, and the shared
   libraries copied beside it, with a ``build_record.json`` that ``doctor`` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = Path(__file__).resolve().parent
NATIVE_DIR = PACKAGE_DIR / "_native"
PATCHES_DIR = PROJECT_ROOT / "patches"

# The pinned llama.cpp: llama-cpp-python 0.3.36 vendors ggml-org/llama.cpp@0c1e57098
# (tree of 2026-10-01), which has DFlash, mtmd, llama_batch_ext/llama_process and
# src/llama-ext.h.
PIN_PACKAGE = "llama-cpp-python"
PIN_VERSION = "0.3.36"
PIN_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PIN_UPSTREAM_COMMIT = "0c1e57098"
PIN_UPSTREAM_DATE = "2026-10-01"
SDIST_NAME = f"llama_cpp_python-{PIN_VERSION}.tar.gz"

BACKENDS = ("cpu", "cuda", "rocm", "vulkan", "metal")
RPC_SERVER = "ggml-rpc-server"  # tools/rpc's target and executable at this pin (upstream docs call it rpc-server)
CFFI_MODULE = "pyllama_spec._native._pyllama_cffi"
DECL_FILES = ("ggml.h", "llama.h", "mtmd.h", "shim.h")  # order matters: later files use earlier types


class BuildError(RuntimeError):
    """The native build cannot go on; the message says what is missing and how to get it."""


def cache_root() -> Path:
    """Where sources and builds are cached: $PYLLAMA_SPEC_CACHE or ~/.cache/pyllama-spec."""
    env = os.environ.get("PYLLAMA_SPEC_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pyllama-spec"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _say(msg: str) -> None:
    print(f"[pyllama-spec build] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- source


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


# --------------------------------------------------------------------------- backends


@dataclasses.dataclass
class BuildOptions:
    backend: str = "cpu"
    cuda_arch: str | None = None  # e.g. "90" or "86;90"
    cublas_dir: str | None = None  # folder with libcublas(.so) when not inside the CUDA toolkit
    llama_cpp: str | None = None  # user's checkout instead of the pin
    cmake_args: tuple[str, ...] = ()  # passed through (also read from $CMAKE_ARGS)
    build_type: str = "Release"
    jobs: int | None = None
    tools: bool = False  # also build llama-server (for benchmarks only)
    # ggml's RPC backend (remote devices) and its ggml-rpc-server: small (two source files), so
    # part of every build unless turned off here or by -DGGML_RPC=OFF in the CMake arguments
    rpc: bool = True


def _cmake_switch(cmake_args: list[str] | str, flag: str) -> bool | None:
    """What the last -D<flag>=... among CMake arguments says (None when it is not there)."""
    text = " ".join(cmake_args) if isinstance(cmake_args, list) else cmake_args
    found = re.findall(rf"-D{flag}(?::BOOL)?=(\S+)", text)
    return found[-1].lower() in ("on", "1", "true", "yes") if found else None


def rpc_wanted(opts: BuildOptions) -> bool:
    """Whether this build has ggml's RPC backend: the option, unless CMake arguments say otherwise."""
    said = _cmake_switch(_extra_cmake_args(opts), "GGML_RPC")
    return opts.rpc if said is None else said


def feature_cmake_args(opts: BuildOptions) -> list[str]:
    """CMake flags of the optional parts every backend can have (RPC)."""
    return ["-DGGML_RPC=ON"] if opts.rpc else []


def backend_from_cmake_args(cmake_args: str) -> str:
    """The backend a llama-cpp-python style CMAKE_ARGS asks for (e.g. "-DGGML_CUDA=on"), else "cpu"."""
    for backend, flag in (("cuda", "GGML_CUDA"), ("rocm", "GGML_HIP"), ("vulkan", "GGML_VULKAN"),
                          ("metal", "GGML_METAL")):
        if re.search(rf"-D{flag}=(on|1|true|yes)\b", cmake_args, re.IGNORECASE):
            return backend
    return "cpu"


def _find_nvcc() -> Path | None:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and Path(cand).exists():
            return Path(cand)
    return None


def _find_cublas(opts: BuildOptions, nvcc: Path) -> tuple[Path, Path] | None:
    """(library dir, include dir) of a cuBLAS, in the toolkit or elsewhere."""
    toolkit = nvcc.resolve().parent.parent
    candidates: list[Path] = []
    for explicit in (opts.cublas_dir, os.environ.get("PYLLAMA_CUBLAS_DIR")):
        if explicit:
            candidates.append(Path(explicit).expanduser())
    candidates += [toolkit / "lib64", toolkit / "targets" / f"{platform.machine()}-linux" / "lib"]
    for site in sys.path:  # the nvidia-cublas wheel: site-packages/nvidia/cu13/lib
        candidates += [Path(p) for p in glob.glob(os.path.join(site, "nvidia", "*", "lib"))]
    for cand in candidates:
        libs = sorted(cand.glob("libcublas.so*"))
        if libs:
            include = cand.parent / "include"
            return cand, include
    return None


def _unversioned_links(lib_dir: Path) -> Path:
    """A folder with libcublas.so / libcublasLt.so links (wheels only ship .so.N)."""
    out = cache_root() / "cublas-links" / hashlib.sha256(str(lib_dir).encode()).hexdigest()[:12]
    out.mkdir(parents=True, exist_ok=True)
    for stem in ("libcublas", "libcublasLt"):
        plain = lib_dir / f"{stem}.so"
        versioned = sorted(lib_dir.glob(f"{stem}.so.*"))
        src = plain if plain.exists() else (versioned[0] if versioned else None)
        if src is None:
            raise BuildError(f"{lib_dir} has no {stem}.so*")
        link = out / f"{stem}.so"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(src)
    return out


def backend_cmake_args(opts: BuildOptions) -> list[str]:
    """CMake flags for the backend, after checking that its toolchain is there."""
    b = opts.backend
    if b == "cpu":
        return []
    if b == "cuda":
        nvcc = _find_nvcc()
        if nvcc is None:
            raise BuildError("--cuda needs the CUDA toolkit's nvcc: not found in $CUDACXX, $PATH or "
                             "$CUDA_HOME/bin. Install the CUDA toolkit (developer.nvidia.com/cuda-downloads) "
                             "or point CUDACXX at nvcc.")
        cublas = _find_cublas(opts, nvcc)
        if cublas is None:
            raise BuildError("--cuda needs cuBLAS and none was found in the CUDA toolkit, in --cublas-dir / "
                             "$PYLLAMA_CUBLAS_DIR, or in an installed nvidia-cublas wheel. "
                             "Run `pip install nvidia-cublas` (or the toolkit's cuBLAS package) and, "
                             "if it is not found then, pass --cublas-dir DIR (the folder holding libcublas.so*).")
        lib_dir, include_dir = cublas
        links = _unversioned_links(lib_dir)
        args = [f"-DCMAKE_CUDA_COMPILER={nvcc}", "-DGGML_CUDA=ON",
                f"-DCUDA_cublas_LIBRARY={links / 'libcublas.so'}",
                f"-DCUDA_cublasLt_LIBRARY={links / 'libcublasLt.so'}"]
        if include_dir.is_dir():
            args += [f"-DCMAKE_CUDA_FLAGS=-I{include_dir}", f"-DCMAKE_CXX_FLAGS=-I{include_dir}"]
        if not _has_cuda_driver(nvcc):
            args.append("-DGGML_CUDA_NO_VMM=ON")  # no libcuda to link against here
        if opts.cuda_arch:
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={opts.cuda_arch}")
        _say(f"CUDA: nvcc {nvcc}, cuBLAS {lib_dir}")
        return args
    if b == "rocm":
        hipcc = shutil.which("hipcc") or ("/opt/rocm/bin/hipcc" if Path("/opt/rocm/bin/hipcc").exists() else None)
        if hipcc is None:
            raise BuildError("--rocm needs ROCm's hipcc (and hipBLAS): not found in $PATH or /opt/rocm/bin. "
                             "Install ROCm (rocm.docs.amd.com), including hipblas-dev.")
        rocm = Path(hipcc).resolve().parent.parent
        if not any(rocm.glob("lib*/libhipblas.so*")) and not any(Path("/opt/rocm").glob("lib*/libhipblas.so*")):
            raise BuildError(f"--rocm found hipcc ({hipcc}) but no hipBLAS (libhipblas.so); install hipblas-dev")
        return ["-DGGML_HIP=ON", f"-DCMAKE_HIP_COMPILER={hipcc}"]
    if b == "vulkan":
        if shutil.which("glslc") is None:
            raise BuildError("--vulkan needs the glslc shader compiler: install it (Debian: apt-get install glslc) "
                             "or the Vulkan SDK (vulkan.lunarg.com)")
        headers = [Path("/usr/include/vulkan/vulkan.h")]
        if os.environ.get("VULKAN_SDK"):
            headers.append(Path(os.environ["VULKAN_SDK"]) / "include" / "vulkan" / "vulkan.h")
        if not any(h.exists() for h in headers):
            raise BuildError("--vulkan needs the Vulkan headers and loader: apt-get install libvulkan-dev, "
                             "or set VULKAN_SDK")
        return ["-DGGML_VULKAN=ON"]
    if b == "metal":
        if sys.platform != "darwin":
            raise BuildError("--metal builds only on macOS (Apple's Metal framework)")
        return ["-DGGML_METAL=ON"]
    raise BuildError(f"unknown backend {b!r}; choose one of {', '.join(BACKENDS)}")


def _has_cuda_driver(nvcc: Path) -> bool:
    toolkit = nvcc.resolve().parent.parent
    stubs = list(toolkit.glob("lib64/stubs/libcuda.so")) + list(toolkit.glob("targets/*/lib/stubs/libcuda.so"))
    return bool(stubs)


# --------------------------------------------------------------------------- cmake


@dataclasses.dataclass(frozen=True)
class NativeBuild:
    """The result of a build: where the libraries are and how they were made."""

    build_dir: Path
    lib_dir: Path
    source: Source
    backend: str
    cmake_args: tuple[str, ...]
    key: str
    rpc: bool = False  # ggml's RPC backend and ggml-rpc-server were built

    def include_dirs(self) -> list[Path]:
        s = self.source.path
        return [s / "include", s / "ggml" / "include", s / "tools" / "mtmd", PROJECT_ROOT / "native"]


def _extra_cmake_args(opts: BuildOptions) -> list[str]:
    import shlex

    return list(opts.cmake_args) + shlex.split(os.environ.get("CMAKE_ARGS", ""))


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


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


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


def _nothing_to_do(build_output: str) -> bool:
    """Whether a `cmake --build` compiled no source file (ninja and make both say "Building ...
    object" for each; a folder configured again may still relink or refresh library links)."""
    return not re.search(r"Building (C|CXX|CUDA|HIP|ASM) object", build_output)


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
    compiled = configure_and_build(tools, project, build_dir, configure, targets, opts.jobs or os.cpu_count() or 2)
    _write_build_summary(build_dir, compiled=compiled)
    return NativeBuild(build_dir, build_dir / "bin", source, opts.backend, tuple(cmake_args), key,
                       rpc=rpc_wanted(opts))


def _write_build_summary(build_dir: Path, **facts) -> None:
    """``last-build.json`` in the build folder: what the latest build compiled (CI reads it to
    check that a second install compiles nothing)."""
    path = build_dir / "last-build.json"
    summary = json.loads(path.read_text()) if path.exists() and "cffi" in facts else {}
    summary.update(facts, at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    path.write_text(json.dumps(summary, indent=2) + "\n")


def find_llama_server() -> Path | None:
    """The most recently built llama-server in the build cache (``build.py --tools`` makes one)."""
    found = sorted((cache_root() / "build").glob("*/bin/llama-server"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


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


# --------------------------------------------------------------------------- cffi module


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


PACKAGED_LIBS = ("libllama.", "libmtmd.", "libggml", "libpyllama_shim.")


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


def dflash_capable_archs(source_dir: Path) -> list[str]:
    """Target architectures whose graph records layer inputs (a DFlash target must).

    Read from the source that was built: a file under src/models/ records them when it
    assigns ``t_layer_inp[...]``; the classes it defines (``llama_model_foo::``) map to
    architectures through the factory switch in src/llama-model.cpp
    (``case LLM_ARCH_FOO: return new llama_model_foo(...)``) and to GGUF names through
    src/llama-arch.cpp.
    """
    recording_classes: set[str] = set()
    for path in (source_dir / "src" / "models").glob("*.cpp"):
        text = path.read_text(errors="replace")
        if "t_layer_inp[" in text:
            recording_classes.update(re.findall(r"\bllama_model_([a-z0-9_]+)::", text))
    factory = (source_dir / "src" / "llama-model.cpp").read_text(errors="replace")
    arch_names = dict(re.findall(r"\{\s*(LLM_ARCH_[A-Z0-9_]+)\s*,\s*\"([^\"]+)\"\s*\}",
                                 (source_dir / "src" / "llama-arch.cpp").read_text(errors="replace")))
    found = {arch_names[arch] for arch, cls in
             re.findall(r"case\s+(LLM_ARCH_[A-Z0-9_]+)\s*:\s*return\s+new\s+llama_model_([a-z0-9_]+)\s*\(", factory)
             if cls in recording_classes and arch in arch_names}
    return sorted(found)


def write_build_record(build: NativeBuild, path: Path) -> None:
    record = {
        "pin": {"package": PIN_PACKAGE, "version": PIN_VERSION, "sha256": PIN_SHA256,
                "upstream_commit": PIN_UPSTREAM_COMMIT, "upstream_date": PIN_UPSTREAM_DATE},
        "source": {"origin": build.source.origin, "path": str(build.source.path),
                   "identity": build.source.identity},
        "patches": list(build.source.patches),
        "backend": build.backend,
        "cmake_args": list(build.cmake_args),
        "build_dir": str(build.build_dir),
        "key": build.key,
        "rpc": build.rpc,
        "dflash_target_archs": dflash_capable_archs(build.source.path),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path.write_text(json.dumps(record, indent=2) + "\n")


# --------------------------------------------------------------------------- entry point


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


if __name__ == "__main__":
    sys.exit(main())
