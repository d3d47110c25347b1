#!/usr/bin/env python3
"""Build pyllama-spec's native part in place: `python build.py [--cuda|--rocm|--vulkan|--metal]`.

The work is done by pyllama_spec/native_build.py, loaded by path so that this runs
before the package (which needs the native part) can be imported.
"""
import importlib.util
import sys
from pathlib import Path


def load_native_build():
    path = Path(__file__).resolve().parent / "pyllama_spec" / "native_build.py"
    spec = importlib.util.spec_from_file_location("pyllama_spec_native_build", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    sys.exit(load_native_build().main())
