"""Decoding token by token on one of an engine's slots: llama-cpp-python's ``eval``, ``sample`` and
``save_state`` / ``load_state``, for the facade (``pyllama_spec.llama_cpp``).

llama-cpp-python lets a program decode tokens into its context, pick the next token with a sampler
chain it builds per call, and take the whole state out and put it back. Here each of those acts on one
slot's ``Sequence`` (speculative/sequence.py) through ``Engine.run_on_slot``: the rows go in at the
sequence's own positions, the drafter sees them, and the sequence's prompt cache records them, so a
completion after an ``eval`` reuses what was decoded, and an ``eval`` after a completion continues it.

    steps = TokenSteps(engine)
    logits = steps.eval(kept=np.array([...]), new=np.array([...]))   # the last row's logits
    with steps.sampler(temperature=0.0) as sampler:
        token = sampler.sample()                                      # from the last decode's last row
    saved = steps.save()                                              # a SavedSequence
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from typing import Any

import numpy as np

from pyllama_spec.bindings.sampler import Sampler
from pyllama_spec.speculative.sequence import CachedMedia, SavedSequence, Sequence
from pyllama_spec.speculative.stats import GenerationStats

#: A logits processor, as llama-cpp-python calls one: (tokens so far, logits) -> logits.
LogitsHook = Callable[[np.ndarray, np.ndarray], np.ndarray]


class TokenSteps:
    """Token-level decoding on slot ``slot`` of ``engine`` (see the module)."""

    def __init__(self, engine: Any, slot: int = 0) -> None:
        self.engine, self.slot = engine, slot
        self._outputs = 0  # output rows of this object's last decode (what sample() may read)

    def _on_slot(self, fn: Callable[[Sequence], Any]) -> Any:
        return self.engine.run_on_slot(self.slot, fn).result()

    # ------------------------------------------------------------------ what the slot holds
    def held(self) -> np.ndarray | None:
        """The text tokens the slot's cache holds, in order; None when it holds a media item (a
        picture's rows are not tokens)."""
        def read(seq: Sequence) -> np.ndarray | None:
            if any(isinstance(p, CachedMedia) for p in seq.cached):
                return None
            return np.concatenate(seq.cached) if seq.cached else np.zeros(0, dtype=np.int32)

        return self._on_slot(read)

    def forget(self) -> None:
        """Empty the slot: the next eval decodes from position 0."""
        self._outputs = 0
        self._on_slot(lambda seq: seq.reset())

    @property
    def has_outputs(self) -> bool:
        """Whether the context still holds the output rows of this object's last eval."""
        return self._outputs > 0

    def drop_outputs(self) -> None:
        """The context decoded something else since this object's last eval (a generation): its
        output rows are no longer there to sample from."""
        self._outputs = 0

    # ------------------------------------------------------------------ decoding
    def eval(self, kept: Seq[int], new: Seq[int], *, all_logits: bool = False) -> np.ndarray:
        """Make the slot hold ``kept`` + ``new`` and decode what it does not hold yet, in batches of
        the engine's n_batch; return the logits of the decoded rows (all of them with ``all_logits``,
        else the last), float32 [rows, n_vocab].

        What the slot already holds of ``kept`` + ``new`` is reused (the engine's prompt cache); the
        last token is always decoded again, so that its logits are fresh. A target that cannot cut its
        memory back (a recurrent model) decodes everything again. ValueError when the tokens do not
        fit the slot's share of the context."""
        tokens = np.concatenate([np.asarray(kept, dtype=np.int32).ravel(), np.asarray(new, dtype=np.int32).ravel()])
        if not len(tokens):
            raise ValueError("eval: no tokens to decode")
        n_vocab = int(self.engine.model.n_vocab)
        bad = tokens[(tokens < 0) | (tokens >= n_vocab)]
        if len(bad):
            raise ValueError(f"eval: token {int(bad[0])} is not in the vocabulary (0..{n_vocab - 1})")
        n_batch = int(self.engine.config.n_batch)

        def run(seq: Sequence) -> np.ndarray:
            if len(tokens) > seq.n_ctx:
                raise ValueError(f"eval: {len(tokens)} tokens do not fit the context: it holds {seq.n_ctx} "
                                 "(Llama(n_ctx=...))")
            (rest,) = seq.keep_prefix([tokens])  # text only: one part in, at most one part out
            stats = GenerationStats()
            rows = []
            for s in range(0, len(rest), n_batch):
                chunk = rest[s:s + n_batch]
                last = s + n_batch >= len(rest)
                outputs: bool | np.ndarray = True if all_logits else \
                    (np.arange(len(chunk)) == len(chunk) - 1) if last else False
                self._outputs = 0
                seq.decode_text(chunk, outputs, stats)
                if all_logits or last:
                    n_out = len(chunk) if all_logits else 1
                    rows.append(seq.ctx.output_logits(n_out).copy())  # a view, valid until the next decode
                    self._outputs = n_out
            return np.concatenate(rows)

        return self._on_slot(run)

    def sampler(self, *, temperature: float, seed: int, grammar: str | None = None, **settings: Any) -> "TokenSampler":
        """A sampler chain for ``sample`` (Sampler's settings: top_k, top_p, min_p, typical_p,
        repeat_penalty, mirostat, ...; ``samplers`` its order). Close it (or use ``with``)."""
        return TokenSampler(self, Sampler(self.engine.model, temperature=temperature, seed=seed, grammar=grammar,
                                          **settings))

    # ------------------------------------------------------------------ saving and restoring
    def save(self) -> SavedSequence:
        """What the slot holds (its memory, parts and positions), to put back with ``restore``."""
        return self._on_slot(lambda seq: seq.save_state())

    def restore(self, saved: SavedSequence) -> None:
        """Make the slot hold what ``saved`` holds (KVMemoryError when this context refuses it: the
        slot is then empty)."""
        self._outputs = 0
        self._on_slot(lambda seq: seq.restore_state(saved))

    def restore_tokens(self, tokens: Seq[int], memory: bytes) -> None:
        """``restore`` of text ``tokens`` and a memory image taken elsewhere (llama-cpp-python's LlamaState
        holds only these), laid out by the slot's own draft position mode."""
        parts = (np.asarray(tokens, dtype=np.int32),)
        self._outputs = 0
        self._on_slot(lambda seq: seq.restore_state(SavedSequence(parts, seq.positions.draft_positions, memory)))


class TokenSampler:
    """A sampler chain that picks tokens from the output rows of ``TokenSteps``' last decode."""

    def __init__(self, steps: TokenSteps, sampler: Sampler) -> None:
        self._steps, self._sampler = steps, sampler

    def sample(self, row: int = -1, *, hooks: Seq[LogitsHook] = (), history: np.ndarray | None = None) -> int:
        """The token picked at output ``row`` of the last eval (negative: from its last output row),
        then accepted by the chain (a grammar moves on, penalties count it). ``hooks`` change the
        row's logits first, as llama-cpp-python's ``logits_processor`` (each gets ``history``, the
        tokens so far, and the logits, in vocabulary order, and returns the logits)."""
        n_out = self._steps._outputs
        if not n_out:
            raise RuntimeError("sample: nothing was decoded since the slot last changed (call eval first)")
        if not -n_out <= row < n_out:
            raise IndexError(f"sample: row {row} is not among the last eval's {n_out} output rows")

        def pick(seq: Sequence) -> int:
            # (llama.cpp counts a negative row from the last output; a row >= 0 would be a batch index)
            at = row - n_out if row >= 0 else row
            if not hooks:
                return self._sampler.sample(seq.ctx, at)
            logits = seq.ctx.output_logits(n_out)[row]  # a view: the chain reads what the hooks write there
            original = logits.copy()
            try:
                changed = original.copy()
                for hook in hooks:
                    changed = np.asarray(hook(history if history is not None else np.zeros(0, np.int32), changed),
                                         dtype=np.float32)
                    if changed.shape != original.shape:
                        raise ValueError(f"a logits processor returned shape {changed.shape}, not {original.shape}")
                logits[:] = changed
                return self._sampler.sample(seq.ctx, at)
            finally:
                logits[:] = original  # the row is the model's again: a later sample sees no hook's edit

        return self._steps._on_slot(pick)

    def close(self) -> None:
        self._sampler.close()

    def __enter__(self) -> "TokenSampler":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
