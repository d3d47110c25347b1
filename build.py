#!/usr/bin/env python3
"""Build pyllama-spec's native part in place: `python build.py [--cuda|--rocm|--vulkan|--metal]`.

The work is done by the package pyllama_spec/native_build/, loaded by path so that this runs
before the package (which needs the native part) can be imported. `load_native_build` is
the one loader: setup.py (inside `pip install .`) and the tests use it too.
"""
import importlib.util
import sys
from pathlib import Path

NAME = "pyllama_spec_native_build"


def load_native_build():
    """pyllama_spec/native_build/ as the package `pyllama_spec_native_build`, without importing
    pyllama_spec (its modules import each other relatively, and nothing else of pyllama_spec)."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    folder = Path(__file__).resolve().parent / "pyllama_spec" / "native_build"
    spec = importlib.util.spec_from_file_location(NAME, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module  # before exec: its relative imports and dataclasses look it up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[NAME]
        raise
    return module


if __name__ == "__main__":
    sys.exit(load_native_build().main())
