"""Log-probabilities in llama-server's response shapes.

One entry per emitted token, as llama-server's ``completion_token_output::probs_vector_to_json``
writes it: ``{"id", "token", "bytes", "logprob", "top_logprobs": [{"id", "token", "bytes",
"logprob"}, ...]}``: ``token`` is the piece's text (a character cut off at its end dropped), ``bytes`` the
piece's raw bytes (a token can hold part of a character). The chat and completion routes put
the list under ``choices[i].logprobs.content`` (OpenAI's chat shape, which llama-server uses
for both), /completion under ``completion_probabilities``. With ``post_sampling_probs`` the entries
are TokenProb (the probabilities after the sampler chain), written as llama-server writes them then:
``"prob"`` and ``"top_probs"`` (each ``{"id", "token", "bytes", "prob"}``) in place of the log-probabilities.

Token pieces are read from the vocabulary (``Model.token_to_bytes``, read-only and safe
beside a running generation) and kept: a response repeats the same few thousand tokens.
"""

from __future__ import annotations

import math
import sys

from pyllama_spec.speculative.logprobs import TokenProb

#: llama-server writes log(0) as the lowest float (JSON has no -inf): the same here.
_LOWEST = -sys.float_info.max


def _piece_text(data: bytes) -> str:
    """A piece as llama-server shows it: a multi-byte character cut off at the end is dropped
    (its validate_utf8), other invalid bytes become U+FFFD (its JSON writer)."""
    end = len(data)
    for i in range(1, min(4, len(data)) + 1):
        c = data[-i]
        if (c & 0xE0 == 0xC0 and i < 2) or (c & 0xF0 == 0xE0 and i < 3) or (c & 0xF8 == 0xF0 and i < 4):
            end = len(data) - i
            break
    return data[:end].decode("utf-8", errors="replace")


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOWEST


class LogprobFormatter:
    """Writes TokenLogprob entries (speculative/logprobs.py) as llama-server's JSON."""

    def __init__(self, model) -> None:
        self._model = model
        self._pieces: dict[int, tuple[str, list[int]]] = {}

    def _piece(self, token: int) -> tuple[str, list[int]]:
        got = self._pieces.get(token)
        if got is None:
            data = self._model.token_to_bytes(token, special=True)
            got = self._pieces[token] = (_piece_text(data), list(data))
        return got

    def _alternative(self, token: int, logprob: float) -> dict:
        text, raw = self._piece(token)
        return {"id": token, "token": text, "bytes": raw, "logprob": _finite(logprob)}

    def _probability(self, token: int, prob: float) -> dict:
        text, raw = self._piece(token)
        return {"id": token, "token": text, "bytes": raw, "prob": prob}

    def entries(self, logprobs) -> list[dict]:
        out = []
        for lp in logprobs:
            if isinstance(lp, TokenProb):
                entry = self._probability(lp.token, lp.prob)
                entry["top_probs"] = [self._probability(t, p) for t, p in lp.top]
            else:
                entry = self._alternative(lp.token, lp.logprob)
                entry["top_logprobs"] = [self._alternative(t, v) for t, v in lp.top]
            out.append(entry)
        return out
