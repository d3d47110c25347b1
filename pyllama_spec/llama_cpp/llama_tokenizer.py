"""llama-cpp-python's tokenizers: ``LlamaTokenizer`` (a ``Llama``'s own vocabulary) and
``LlamaHFTokenizer`` (a Hugging Face tokenizer object, for a ``Llama(tokenizer=...)`` elsewhere)."""

from __future__ import annotations

import abc
from typing import Any


class BaseLlamaTokenizer(abc.ABC):
    @abc.abstractmethod
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]: ...

    @abc.abstractmethod
    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes: ...


class LlamaTokenizer(BaseLlamaTokenizer):
    """The vocabulary of a ``Llama``."""

    def __init__(self, llama: Any) -> None:
        self._llama = llama

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        return self._llama.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes:
        return self._llama.detokenize(tokens, special=special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos, special=special)

    def decode(self, tokens: list[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")

    #: ``Llama(model_path=path, vocab_only=True)``: set by llama.py, which imports this module
    _vocabulary_of: Any = None

    @classmethod
    def from_ggml_file(cls, path: str) -> "LlamaTokenizer":
        """The tokenizer of a GGUF's vocabulary (loaded alone: no weights)."""
        return cls(cls._vocabulary_of(path))


class LlamaHFTokenizer(BaseLlamaTokenizer):
    """A Hugging Face tokenizer (``transformers``), called as llama-cpp-python calls it."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf_tokenizer = hf_tokenizer

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.hf_tokenizer.encode(text.decode("utf-8", errors="ignore"), add_special_tokens=special)

    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes:
        skip = not special
        if prev_tokens is not None:
            text = self.hf_tokenizer.decode(prev_tokens + tokens, skip_special_tokens=skip).encode("utf-8", "ignore")
            prev = self.hf_tokenizer.decode(prev_tokens, skip_special_tokens=skip).encode("utf-8", "ignore")
            return text[len(prev):]
        return self.hf_tokenizer.decode(tokens, skip_special_tokens=skip).encode("utf-8", errors="ignore")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str) -> "LlamaHFTokenizer":
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError("LlamaHFTokenizer needs the transformers library: pip install transformers") from None
        return cls(AutoTokenizer.from_pretrained(pretrained_model_name_or_path=pretrained_model_name_or_path))
