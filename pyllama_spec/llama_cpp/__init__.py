"""A drop-in for llama-cpp-python's high-level API (``llama_cpp`` 0.3.36) on this project's engine.

    from pyllama_spec import llama_cpp            # was: import llama_cpp
    from pyllama_spec.llama_cpp import Llama      # was: from llama_cpp import Llama

or, for code that imports ``llama_cpp`` itself::

    import sys, pyllama_spec.llama_cpp
    sys.modules["llama_cpp"] = pyllama_spec.llama_cpp

What it has: ``Llama`` (``llama``) with its token-level calls and its state, the prompt caches
(``llama_cache``), the tokenizers (``llama_tokenizer``), ``LlamaGrammar`` (``llama_grammar``), the draft models of
``llama_speculative`` (llama-cpp-python's prompt lookup, and DFlash, EAGLE3, MTP and draft-model drafts,
pictures included), the multimodal chat handlers of ``llama_chat_format`` and the types of
``llama_types``. Not here: the raw ctypes bindings (``llama_cpp.llama_cpp``) and its server
(``pyllama-spec serve`` is this project's). docs/llama_cpp.md says what differs and why.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from pyllama_spec.llama_cpp import (
    llama_cache,
    llama_chat_format,
    llama_grammar,
    llama_speculative,
    llama_tokenizer,
    llama_types,
)
from pyllama_spec.llama_cpp.llama import (
    LLAMA_DEFAULT_SEED,
    Llama,
    LlamaState,
    LogitsProcessorList,
    MinTokensLogitsProcessor,
    StoppingCriteriaList,
)
from pyllama_spec.llama_cpp.llama_cache import BaseLlamaCache, LlamaCache, LlamaDiskCache, LlamaRAMCache
from pyllama_spec.llama_cpp.llama_tokenizer import BaseLlamaTokenizer, LlamaHFTokenizer, LlamaTokenizer
from pyllama_spec.llama_cpp.llama_grammar import LlamaGrammar
from pyllama_spec.llama_cpp.llama_types import *  # noqa: F403 (llama_cpp re-exports its types)

#: The llama-cpp-python API this facade follows.
__version__ = "0.3.36"


def __getattr__(name: str):
    # llama-cpp-python's package also re-exports its raw ctypes bindings (llama_cpp.llama_cpp): say so
    if name.lower().startswith(("llama_", "ggml_", "gguf_", "mtmd_")):
        raise AttributeError(f"llama_cpp.{name}: a name of llama-cpp-python's raw ctypes bindings "
                             "(llama_cpp.llama_cpp), which pyllama_spec.llama_cpp does not carry; its high-level "
                             "API (Llama, ...) is here (docs/llama_cpp.md)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _SubmoduleAliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """With ``sys.modules["llama_cpp"]`` pointed at this package, ``import llama_cpp.llama_speculative``
    (and the other submodules) gives this package's own module, not a second copy of its file: a
    second copy would hold other classes, and ``isinstance`` checks across the two would fail."""

    def find_spec(self, fullname, path=None, target=None):
        head, _, tail = fullname.partition(".")
        package = sys.modules.get(__name__)
        if head != "llama_cpp" or not tail or package is None or sys.modules.get("llama_cpp") is not package:
            return None
        own = f"{__name__}.{tail}"
        try:
            module = importlib.import_module(own)
        except ModuleNotFoundError as e:
            if e.name == own:
                return None  # not one of ours: the import fails as it would
            raise
        spec = importlib.util.spec_from_loader(fullname, self, origin=getattr(module, "__file__", None))
        spec.loader_state = module
        return spec

    def create_module(self, spec):
        module = spec.loader_state
        spec.loader_state = (module, module.__spec__, module.__loader__)  # put back by exec_module
        return module

    def exec_module(self, module):
        # the module ran once, under its own name: keep its own spec (importlib wrote the alias's)
        _, own_spec, own_loader = module.__spec__.loader_state
        module.__spec__, module.__loader__ = own_spec, own_loader


# one finder, also after a reload of this package (whose class is then a new one)
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__qualname__ != _SubmoduleAliases.__qualname__
                    or type(f).__module__ != __name__]
sys.meta_path.insert(0, _SubmoduleAliases())
