"""pyllama-spec: vision-language models with DFlash speculative decoding on llama.cpp.

The native part loads on first use of anything that needs it, so that
``pyllama-spec doctor`` and ``build`` work before it is built.
"""

from __future__ import annotations

from pyllama_spec.embedded import embedded_models
from pyllama_spec.errors import (
    ChatTemplateError,
    ClosedError,
    ContextFullError,
    ContextOverflowError,
    DecodeError,
    EngineBusyError,
    GenerationCancelledError,
    ImageError,
    IncompatibleModelsError,
    InsufficientMemoryError,
    KVMemoryError,
    ModelFileError,
    NativeCallError,
    NativeLibraryError,
    ProjectorError,
    PyllamaError,
    RemoteDeviceError,
    TrainingLengthWarning,
)
from pyllama_spec.speculative.stats import GenerationStats

__version__ = "0.1.0"

# Names whose modules load the native part, imported on first use.
_LAZY = {
    "load": "serving.engine", "Engine": "serving.engine", "EngineConfig": "serving.config",
    "Result": "speculative.generation", "Piece": "speculative.generation",
    "Conversation": "serving.conversation", "Submission": "serving.slot_loop",
    "Request": "serving.request", "RequestOptions": "serving.request",
    "Embedding": "serving.embeddings", "EmbeddingInput": "serving.embeddings",
    "Model": "bindings.model", "Context": "bindings.context", "Memory": "bindings.context", "Sampler": "bindings.sampler",
    "Batch": "bindings.batch",
    "MEDIA_MARKER": "bindings.mtmd",  # mtmd's default media marker, as libmtmd says it
    "Projector": "bindings.mtmd", "Bitmap": "bindings.mtmd", "Chunks": "bindings.mtmd", "Chunk": "bindings.mtmd",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'pyllama_spec' has no attribute {name!r}")


__all__ = [
    "ClosedError", "ContextFullError", "ContextOverflowError", "DecodeError", "EngineBusyError",
    "GenerationCancelledError", "GenerationStats", "ChatTemplateError", "ImageError", "IncompatibleModelsError", "InsufficientMemoryError",
    "KVMemoryError", "ModelFileError", "NativeCallError", "NativeLibraryError", "ProjectorError",
    "PyllamaError", "RemoteDeviceError", "TrainingLengthWarning", "embedded_models", *_LAZY,
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
