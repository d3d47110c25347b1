"""``llama_cpp._internals``: llama-cpp-python's ctypes wrappers of llama.cpp's model, context, batch and
sampler. This facade has none of them: llama.cpp is reached through this project's binding layer, and
what ``Llama`` needs of it is ``Llama``'s own API. The module exists so that a program importing it
still imports; using any of its names raises AttributeError that says so."""

from __future__ import annotations


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"llama_cpp._internals.{name}: llama-cpp-python's ctypes layer is not part of "
                         "pyllama_spec.llama_cpp (use Llama's methods: tokenize, eval, sample, generate, "
                         "save_state, ...; docs/llama_cpp.md)")
