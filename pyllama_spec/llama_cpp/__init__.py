"""A drop-in for llama-cpp-python's high-level API (``llama_cpp`` 0.3.36) on this project's engine.

    from pyllama_spec import llama_cpp            # was: import llama_cpp
    from pyllama_spec.llama_cpp import Llama      # was: from llama_cpp import Llama

or, for code that imports ``llama_cpp`` itself::

    import sys, pyllama_spec.llama_cpp
    sys.modules["llama_cpp"] = pyllama_spec.llama_cpp

What it has: ``Llama`` (``llama``), ``LlamaGrammar`` (``llama_grammar``), the draft models of
``llama_speculative`` (llama-cpp-python's prompt lookup, and DFlash, EAGLE3, MTP and draft-model drafts,
pictures included), the multimodal chat handlers of ``llama_chat_format`` and the types of
``llama_types``. Not here: the raw ctypes bindings (``llama_cpp.llama_cpp``) and its server
(``pyllama-spec serve`` is this project's). docs/llama_cpp.md says what differs and why.
"""

from __future__ import annotations

from pyllama_spec.llama_cpp import llama_chat_format, llama_grammar, llama_speculative, llama_types
from pyllama_spec.llama_cpp.llama import LLAMA_DEFAULT_SEED, Llama, LogitsProcessorList, StoppingCriteriaList
from pyllama_spec.llama_cpp.llama_grammar import LlamaGrammar
from pyllama_spec.llama_cpp.llama_types import *  # noqa: F403 (llama_cpp re-exports its types)

#: The llama-cpp-python API this facade follows.
__version__ = "0.3.36"
