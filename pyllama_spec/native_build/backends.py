"""The build's choices: its options, the backend's toolchain (found and checked: CUDA's nvcc and
cuBLAS, ROCm, Vulkan, Metal) and the CMake flags of the backend and of the optional parts."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import platform
import re
import shutil
import sys
from pathlib import Path

from .common import BuildError, cache_root
from .progress import _say


BACKENDS = ("cpu", "cuda", "rocm", "vulkan", "metal")
RPC_SERVER = "ggml-rpc-server"  # tools/rpc's target and executable at this pin (upstream docs call it rpc-server)


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


def _extra_cmake_args(opts: BuildOptions) -> list[str]:
    import shlex

    return list(opts.cmake_args) + shlex.split(os.environ.get("CMAKE_ARGS", ""))


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
