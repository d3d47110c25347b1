"""`pyllama-spec build`: build the native part in place, from a source checkout."""

from __future__ import annotations

import sys

import click

from pyllama_spec.cli.options import err_console


@click.command()
@click.option("--cuda", "backend", flag_value="cuda", help="CUDA backend (GGML_CUDA)")
@click.option("--rocm", "backend", flag_value="rocm", help="ROCm/HIP backend (GGML_HIP)")
@click.option("--vulkan", "backend", flag_value="vulkan", help="Vulkan backend")
@click.option("--metal", "backend", flag_value="metal", help="Metal backend (macOS)")
@click.option("--cuda-arch", help="CMAKE_CUDA_ARCHITECTURES, e.g. 90")
@click.option("--cublas-dir", help="folder with libcublas.so* outside the CUDA toolkit")
@click.option("--llama-cpp", envvar="LLAMA_CPP_DIR", help="your own llama.cpp checkout instead of the pin")
@click.option("--cmake-arg", multiple=True, help="extra CMake argument (repeatable; $CMAKE_ARGS is read too)")
@click.option("--tools", is_flag=True, help="also build llama-server (for benchmarks)")
@click.option("--rpc/--no-rpc", default=True, show_default=True,
              help="ggml's RPC backend (remote devices) and ggml-rpc-server")
@click.option("-j", "--jobs", type=int, help="parallel compile jobs")
def build(backend, cuda_arch, cublas_dir, llama_cpp, cmake_arg, tools, rpc, jobs) -> None:
    """Build (or rebuild) the native part in place, from a source checkout."""
    from pyllama_spec import native_build as nb

    if not (nb.PROJECT_ROOT / "CMakeLists.txt").exists():
        err_console.print("[red]build needs a source checkout[/red] (CMakeLists.txt and native/ are not installed "
                          "with the package): reinstall with e.g. `PYLLAMA_SPEC_BACKEND=cuda pip install .` "
                          "from the source tree")
        sys.exit(2)
    opts = nb.BuildOptions(backend=backend or "cpu", cuda_arch=cuda_arch, cublas_dir=cublas_dir,
                           llama_cpp=llama_cpp, cmake_args=tuple(cmake_arg), jobs=jobs, tools=tools, rpc=rpc)
    try:
        nb.build_in_place(opts)
    except nb.BuildError as e:
        err_console.print(f"[red]build failed:[/red] {e}")
        sys.exit(1)
