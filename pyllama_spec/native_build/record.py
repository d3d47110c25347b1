"""What a build says of itself: its result (``NativeBuild``: where the libraries are and how they
were made), ``build_record.json`` beside the installed module (``doctor`` and the engine's load
checks read it), the DFlash-capable architectures read from the built source, and
``last-build.json`` in the build folder."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

from .common import PROJECT_ROOT
from .source import PIN_PACKAGE, PIN_SHA256, PIN_UPSTREAM_COMMIT, PIN_UPSTREAM_DATE, PIN_VERSION, Source


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


def dflash_capable_archs(source_dir: Path) -> list[str]:
    """Target architectures whose graph records layer inputs (a DFlash target must).

    Read from the source that was built: a file under src/models/ records them when it
    assigns ``t_layer_inp[...]``; the classes it defines (``llama_model_foo::``) map to
    architectures through the factory switch in src/llama-model.cpp
    (``case LLM_ARCH_FOO: return new llama_model_foo(...)``) and to GGUF names through
    src/llama-arch.cpp.
    """
    return _archs_whose_graph_has(source_dir, "t_layer_inp[")


def mtp_capable_archs(source_dir: Path) -> list[str]:
    """Architectures whose model builds an MTP (nextn) draft graph (``LLM_GRAPH_TYPE_DECODER_MTP``),
    read from the built source as ``dflash_capable_archs`` reads its own."""
    return _archs_whose_graph_has(source_dir, "LLM_GRAPH_TYPE_DECODER_MTP")


def _archs_whose_graph_has(source_dir: Path, needle: str) -> list[str]:
    """GGUF architecture names of the model classes whose src/models/ file contains ``needle``."""
    recording_classes: set[str] = set()
    for path in (source_dir / "src" / "models").glob("*.cpp"):
        text = path.read_text(errors="replace")
        if needle in text:
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
        "mtp_target_archs": mtp_capable_archs(build.source.path),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path.write_text(json.dumps(record, indent=2) + "\n")


def _write_build_summary(build_dir: Path, **facts) -> None:
    """``last-build.json`` in the build folder: what the latest build compiled (CI reads it to
    check that a second install compiles nothing)."""
    path = build_dir / "last-build.json"
    summary = json.loads(path.read_text()) if path.exists() and "cffi" in facts else {}
    summary.update(facts, at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    path.write_text(json.dumps(summary, indent=2) + "\n")
