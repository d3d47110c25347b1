"""A model's vocabulary alone: llama.cpp's ``vocab_only`` load (no weights), for tokenizing and
detokenizing (llama-cpp-python's ``Llama(vocab_only=True)``, e.g. on the vocabulary GGUFs of llama.cpp's
``models/``). It holds a context too, as llama-cpp-python's does: llama.cpp makes one on a vocabulary
without weights, and it decodes nothing."""

from __future__ import annotations

import os

from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.model import Model


class Vocabulary:
    """``model`` (tokenize, token_to_bytes, bos, eos, ...) and its empty ``ctx``; close() frees both."""

    def __init__(self, path: str | os.PathLike, *, n_ctx: int = 512) -> None:
        self.model = Model(path, vocab_only=True)
        try:
            self.ctx = Context(self.model, n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_ubatch=min(n_ctx, 512))
        except BaseException:
            self.model.close()
            raise

    def close(self) -> None:
        self.ctx.close()
        self.model.close()
