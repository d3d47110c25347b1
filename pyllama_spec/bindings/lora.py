"""A LoRA adapter (llama.cpp's ``llama_adapter_lora``), loaded against one Model.

The handle is owned by one ``LoraAdapter``, freed by ``close()`` (also on ``with`` exit, by a
guarded finalizer, and by its Model's close: llama.cpp frees a model's adapters with it, so
the model closes them first). A context that uses it (``Context.set_lora``) lets go of it
before it is freed: llama.cpp keeps only the raw pointer.

The file is checked before libllama reads it (``check_adapter_file``): llama.cpp aborts the
process, rather than failing, on a key of the wrong type and on a 3-D pair at the first
decode; its other refusals (a tensor the target lacks, a shape that does not fit) come back
as a ``ModelFileError`` with what llama.cpp said.
"""

from __future__ import annotations

import math
import numbers
import os
import weakref
from typing import Protocol

from pyllama_spec._native import ffi, lib, raise_carried
from pyllama_spec.bindings.handle import NativeHandle
from pyllama_spec.bindings.model import Model, _read_str, check_gguf_file
from pyllama_spec.errors import ModelFileError, forget_native_problems, with_native_log
from pyllama_spec.gguf.reader import ValueType, read_gguf_shared

# The keys llama_adapter_lora_init reads, and the type it reads each as: gguf_get_val_str /
# gguf_get_val_f32 GGML_ASSERT the stored type, so another type aborts the process.
_KEY_TYPES = {"general.type": ValueType.STRING, "general.architecture": ValueType.STRING,
              "adapter.type": ValueType.STRING, "adapter.lora.alpha": ValueType.FLOAT32}
_ALORA_KEY = "adapter.alora.invocation_tokens"


def check_adapter_file(path: str | os.PathLike, model: "Model"):
    """Refuse, before libllama reads it, a file that is not a LoRA adapter for ``model``'s
    architecture, or one llama.cpp would abort on; returns the path. Raises ModelFileError
    naming the file and the problem."""
    p = check_gguf_file(path, "LoRA adapter")  # missing, not GGUF, corrupt, unusable tensor types
    info = read_gguf_shared(p, "LoRA adapter")  # read by that check already: not parsed again

    def refuse(problem: str):
        raise ModelFileError(f"LoRA adapter file {p}: {problem}")

    for key, vtype in _KEY_TYPES.items():
        if key in info.metadata and info.types[key] != (vtype, None):
            refuse(f"{key} is stored as {info.types[key][0].name}, not {vtype.name} (llama.cpp would abort)")
    kind = info.metadata.get("general.type")
    if kind != "adapter":
        refuse(f"not an adapter (general.type is {kind!r}, not 'adapter'): a model file is loaded with -m, "
               "an adapter with --lora")
    if info.metadata.get("adapter.type") != "lora":
        refuse(f"not a LoRA adapter (adapter.type is {info.metadata.get('adapter.type')!r}, not 'lora')")
    if info.arch != model.arch:
        refuse(f"an adapter for the {info.arch!r} architecture; the target {model.path.name} is {model.arch!r}")
    if _ALORA_KEY in info.metadata:
        # llama-server applies an activated LoRA only from its invocation tokens on, which this
        # engine does not do: refused rather than applied to the whole prompt
        refuse(f"an activated LoRA (aLoRA: {_ALORA_KEY}), which is not supported here")
    for t in info.tensors.values():
        if not t.name.endswith((".lora_a", ".lora_b")):
            continue  # llama.cpp skips *_norm.weight and refuses other names cleanly
        if len(t.dims) != 2 or min(t.dims) < 1:
            # a 3-D pair loads, then aborts the first decode in ggml_mul_mat
            refuse(f"tensor {t.name!r} has dims {list(t.dims)}; LoRA tensors are 2-D matrices of rank >= 1")
    return p


class AdapterUser(Protocol):
    """What an adapter asks of a context that applies it (``bindings.context.Context`` is one).
    Said here, so that lora.py needs nothing of context.py, which applies adapters."""

    @property
    def closed(self) -> bool: ...

    def drop_lora(self, adapter: LoraAdapter) -> None: ...


class LoraAdapter(NativeHandle):
    """A LoRA adapter GGUF loaded against the ``model`` it adapts (llama-server's ``--lora``).

    ``path`` is kept as given (llama-server lists it so in GET /lora-adapters); ``alpha``,
    ``task_name`` and ``prompt_prefix`` are the file's ``adapter.lora.*`` keys ("" when absent).
    Apply it with ``Context.set_lora``.

    >>> with LoraAdapter(model, "adapter.gguf") as lora:            # doctest: +SKIP
    ...     ctx.set_lora([lora], [0.5])
    """

    _what = "LoRA adapter"

    def __init__(self, model: "Model", path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.model = model
        #: Contexts whose adapter set includes this one (they let go of it on close).
        self.contexts: weakref.WeakSet[AdapterUser] = weakref.WeakSet()
        p = check_adapter_file(path, model)
        forget_native_problems()
        ptr = lib.llama_adapter_lora_init(model.ptr, str(p).encode())
        raise_carried()
        if ptr == ffi.NULL:
            raise ModelFileError(with_native_log(
                f"llama_adapter_lora_init could not load the LoRA adapter {p} for the target {model.path.name}"))
        self._ptr = ptr
        model.dependents.add(self)  # freed before the model, which would free it too
        alpha = self.meta("adapter.lora.alpha")
        self.alpha = float(alpha) if alpha else 0.0
        self.task_name = self.meta("adapter.lora.task_name") or ""
        self.prompt_prefix = self.meta("adapter.lora.prompt_prefix") or ""

    def meta(self, key: str) -> str | None:
        """A metadata value of the adapter's file as a string (arrays excepted), or None when absent."""
        return _read_str(lib.llama_adapter_meta_val_str, self.ptr, key.encode())

    def _free(self, ptr) -> None:
        for ctx in list(self.contexts):  # no context may keep a pointer to freed memory
            if not ctx.closed:
                ctx.drop_lora(self)
        if not self.model.closed:  # a closed model has freed its adapters already
            lib.llama_adapter_lora_free(ptr)


def check_scales(scales) -> list[float]:
    """LoRA scales as floats; a scale that is not a finite number is a ValueError."""
    out = []
    for s in scales:
        if isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(s):
            raise ValueError(f"a LoRA scale must be a finite number, got {s!r}")
        out.append(float(s))
    return out
