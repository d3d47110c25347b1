"""What the native part says about itself: the build record, the libraries' folder, the
registered ggml backends and devices, the shim's ABI, llama.cpp's system line."""

from __future__ import annotations

import json
from pathlib import Path

from pyllama_spec._native import echo_log_to_stderr, ffi, lib  # noqa: F401 - echo_log_to_stderr: load(verbose=True)

NATIVE_DIR = Path(__file__).resolve().parent.parent / "_native"
LIB_DIR = NATIVE_DIR / "lib"
#: ggml-rpc-server from the same build (beside the libraries its $ORIGIN rpath finds), when built with RPC.
RPC_SERVER_PATH = LIB_DIR / "ggml-rpc-server"


def build_record() -> dict:
    """What build.py recorded about the native part (pin, patches, backend, flags)."""
    path = NATIVE_DIR / "build_record.json"
    return json.loads(path.read_text()) if path.exists() else {}


def backend_names() -> list[str]:
    """The ggml backends this build registered (CPU, CUDA, ...)."""
    return [ffi.string(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i))).decode()
            for i in range(lib.ggml_backend_reg_count())]


def devices() -> list[dict]:
    """Every ggml device: name, description, total and free memory in bytes."""
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        lib.ggml_backend_dev_memory(dev, free, total)
        out.append({"name": ffi.string(lib.ggml_backend_dev_name(dev)).decode(),
                    "description": ffi.string(lib.ggml_backend_dev_description(dev)).decode(),
                    "total": int(total[0]), "free": int(free[0])})
    return out


def shim_abi_version() -> int:
    return int(lib.pyllama_shim_abi_version())


def system_info() -> str:
    return ffi.string(lib.llama_print_system_info()).decode().strip()
