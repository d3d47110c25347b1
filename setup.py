"""Package build: runs the native build (the package pyllama_spec/native_build/) inside `pip install .`.

Backend and flags come from the environment, as llama-cpp-python users expect:
  PYLLAMA_SPEC_BACKEND=cuda|rocm|vulkan|metal   (default: what CMAKE_ARGS asks for, else cpu)
  CMAKE_ARGS="..."                               (passed through to CMake; "-DGGML_CUDA=on" selects cuda)
  LLAMA_CPP_DIR=/path/to/llama.cpp               (your own checkout instead of the pin)
"""
import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


def _native_build():
    """pyllama_spec/native_build/, loaded by path (pyllama_spec is not importable before its native
    part is built) with build.py's loader, the one that knows how."""
    spec = importlib.util.spec_from_file_location("pyllama_build_script", ROOT / "build.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.load_native_build()


class BuildPyWithNative(build_py):
    def run(self):
        super().run()
        nb = _native_build()
        backend = os.environ.get("PYLLAMA_SPEC_BACKEND") or nb.backend_from_cmake_args(os.environ.get("CMAKE_ARGS", ""))
        opts = nb.BuildOptions(backend=backend,
                               llama_cpp=os.environ.get("LLAMA_CPP_DIR") or None,
                               cuda_arch=os.environ.get("PYLLAMA_SPEC_CUDA_ARCH") or None)
        # `pip install -e .` builds in place, like `python build.py`; a normal install into the wheel.
        if getattr(self, "editable_mode", False):
            target = ROOT / "pyllama_spec" / "_native"
        else:
            target = Path(self.build_lib) / "pyllama_spec" / "_native"
        try:
            build = nb.build_native(opts)
            nb.install_native(build, target)
        except nb.BuildError as e:
            sys.exit(f"pyllama-spec native build failed: {e}")


class BinaryDistribution(Distribution):
    def has_ext_modules(self):  # the wheel carries native libraries: make it platform-specific
        return True


setup(cmdclass={"build_py": BuildPyWithNative}, distclass=BinaryDistribution)
