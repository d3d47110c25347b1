"""``Llama``, llama-cpp-python's high-level class, on this project's engine.

A program written for llama-cpp-python 0.3.36 loads its model with ``Llama(model_path, ...)`` and asks
for completions and chats; here each call becomes one of the engine's requests (``Engine.stream``: the
typed request, the slot loop), so a ``draft_model`` may be any of this project's drafters
(``llama_speculative``), and a chat with pictures drafts through them too. The responses are
llama-cpp-python's dicts, field for field, plus one field of this project's: ``"speculative"``, the
generation's drafting statistics (drafted, accepted, acceptance, ...).

The token-level calls (``eval``, ``sample``, ``generate``, ``save_state`` / ``load_state``, ``set_cache``)
act on the engine's one slot (serving/token_steps.py): the same cache the completions use, so an ``eval``
followed by a completion of the same tokens decodes only the last token again. A completion given
``logits_processor`` or ``stopping_criteria`` (Python per token) runs through ``generate``, token by token
and without drafting, as llama-cpp-python runs every completion. ``vocab_only=True`` loads the vocabulary
alone (tokenize, detokenize); ``embedding=True`` serves ``embed`` and ``create_embedding`` (the engine's
``embed``, pictures aside). What cannot apply (a Python draft model of your own) raises
``NotImplementedError`` that says so, and a constructor option that cannot apply warns once. Chats keep a
model's reasoning in ``content`` (``<think>...``), as llama-cpp-python's chat handlers do.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import uuid
import warnings
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import numpy as np

from pyllama_spec.llama_cpp import llama_types as T
from pyllama_spec.llama_cpp import chat_formats
from pyllama_spec.llama_cpp.llama_chat_format import Llava15ChatHandler, MTMDChatHandler, load_image
from pyllama_spec.llama_cpp.llama_cache import (  # noqa: F401 (llama_cpp.llama re-exports them, as there)
    BaseLlamaCache,
    LlamaCache,
    LlamaDiskCache,
    LlamaRAMCache,
    longest_token_prefix,
)
from pyllama_spec.llama_cpp.llama_grammar import LlamaGrammar
from pyllama_spec.llama_cpp.llama_hooks import (  # noqa: F401 (llama_cpp.llama has them, as there)
    LogitsProcessor,
    LogitsProcessorList,
    MinTokensLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
)
from pyllama_spec.llama_cpp.llama_speculative import EngineDraft, LlamaDraftModel
from pyllama_spec.llama_cpp.llama_tokenizer import BaseLlamaTokenizer, LlamaTokenizer  # noqa: F401 (as there)
from pyllama_spec.serving.chat_answer import ChatAnswer
from pyllama_spec.speculative.generation import TextAssembler

LLAMA_DEFAULT_SEED = 0xFFFFFFFF
#: ggml type ids (llama-cpp-python's ``type_k`` / ``type_v``) -> the engine's cache type names.
GGML_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 20: "iq4_nl", 30: "bf16"}

# constructor options with nothing to apply them to here, and their llama-cpp-python defaults
_IGNORED = {"kv_overrides": None, "rope_scaling_type": -1, "attention_type": -1,
            "rope_freq_base": 0.0, "rope_freq_scale": 0.0, "yarn_ext_factor": -1.0, "yarn_attn_factor": 1.0,
            "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_orig_ctx": 0, "offload_kqv": True,
            "op_offload": None, "no_perf": False, "lora_base": None, "numa": False,
            "tokenizer": None}
_SPLIT_MODES = {0: "none", 1: "layer", 2: "row"}
#: llama.cpp's pooling type ids (llama-cpp-python's ``pooling_type``) -> the engine's names.
POOLING_TYPES = {-1: "unspecified", 0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


class LlamaState:
    """A ``Llama``'s saved state (``save_state``), with llama-cpp-python's fields: ``input_ids``,
    ``scores``, ``n_tokens``, ``llama_state`` (the memory image, bytes), ``llama_state_size`` and
    ``seed``; and ``saved``, the engine's own record of what the slot held (pictures included)."""

    def __init__(self, input_ids: np.ndarray, scores: np.ndarray, n_tokens: int, llama_state: bytes,
                 llama_state_size: int, seed: int, saved: Any = None) -> None:
        self.input_ids, self.scores, self.n_tokens = input_ids, scores, n_tokens
        self.llama_state, self.llama_state_size, self.seed = llama_state, llama_state_size, seed
        self.saved = saved


class _ContextView:
    """``Llama._ctx``: what llama-cpp-python's own tests read of its context wrapper (``_ctx.ctx``, the
    context is there; ``n_ctx()``). The native context itself stays in the binding layer."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    @property
    def ctx(self) -> Any:
        """The engine's target context (None once the Llama is closed)."""
        ctx = self._engine.ctx
        return None if ctx is None or ctx.closed else ctx

    def n_ctx(self) -> int:
        return int(self._engine.ctx.n_ctx)


class Llama:
    """A model, its context and its drafter, as llama-cpp-python's ``Llama`` is used."""

    def __init__(self, model_path: str, *, n_gpu_layers: int = 0, split_mode: int = 1, main_gpu: int = 0,
                 tensor_split: Sequence[float] | None = None, vocab_only: bool = False, use_mmap: bool = True,
                 use_mlock: bool = False, seed: int = LLAMA_DEFAULT_SEED, n_ctx: int = 512, n_batch: int = 512,
                 n_ubatch: int = 512, n_threads: int | None = None, n_threads_batch: int | None = None,
                 embedding: bool = False, flash_attn: bool = False, swa_full: bool | None = None,
                 lora_scale: float = 1.0, lora_path: str | None = None, chat_format: str | None = None,
                 chat_handler: MTMDChatHandler | None = None, draft_model: LlamaDraftModel | None = None,
                 type_k: int | None = None, type_v: int | None = None, logits_all: bool = False,
                 last_n_tokens_size: int = 64, verbose: bool = True, pooling_type: int = -1,
                 spm_infill: bool = False, **kwargs: Any) -> None:
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type={pooling_type!r}: llama.cpp's pooling types are {POOLING_TYPES}")
        for name, value in kwargs.items():
            if name not in _IGNORED:
                raise TypeError(f"Llama() got an unexpected keyword argument {name!r}")
            if value != _IGNORED[name]:
                warnings.warn(f"Llama({name}={value!r}) does not apply to pyllama_spec's engine: ignored",
                              stacklevel=2)
        if chat_format in chat_formats.HANDLERS_NOT_HERE:
            warnings.warn(f"chat_format={chat_format!r} is one of llama-cpp-python's own chat handlers, not a format: "
                          "pyllama_spec renders such chats with the model's own template", stacklevel=2)
        self.chat_format = chat_format  # a named format renders the chats (chat_formats), else the template
        self.model_path = str(model_path)
        self.verbose = verbose
        self.spm_infill = spm_infill  # fill-in-the-middle with the suffix first (suffix=)
        self.chat_handler = chat_handler
        self.draft_model = draft_model
        self._seed = seed or LLAMA_DEFAULT_SEED  # llama-cpp-python's: 0 and None mean the default
        settings: dict[str, Any] = dict(
            n_ctx=n_ctx or _trained_context(self.model_path), n_batch=n_batch, n_ubatch=min(n_ubatch, n_batch),
            n_threads=n_threads, n_threads_batch=n_threads_batch, n_gpu_layers=n_gpu_layers,
            split_mode=_split_mode(split_mode), main_gpu=main_gpu, use_mmap=use_mmap,
            use_mlock=use_mlock, flash_attn=flash_attn)
        if tensor_split:
            settings["tensor_split"] = list(tensor_split)
        if swa_full is not None:
            settings["swa_full"] = swa_full
        for name, value in (("cache_type_k", type_k), ("cache_type_v", type_v)):
            if value is not None:
                if value not in GGML_TYPES:
                    raise ValueError(f"{name.replace('cache_', '')}={value}: not a KV cache type this engine knows "
                                     f"(ggml type ids {sorted(GGML_TYPES)})")
                settings[name] = GGML_TYPES[value]
        if lora_path:
            settings["lora"] = [(lora_path, lora_scale)]
        if chat_handler is not None:
            if not isinstance(chat_handler, MTMDChatHandler):
                raise NotImplementedError(
                    f"chat_handler={type(chat_handler).__name__}(...): this facade takes the vision chat handlers of "
                    "llama_chat_format (MTMDChatHandler, Qwen25VLChatHandler, ...), whose clip_model_path is the "
                    "projector")
            settings["mmproj"] = chat_handler.clip_model_path
            if not chat_handler.use_gpu:
                settings["mmproj_offload"] = False
        settings["reasoning_format"] = "none"  # llama-cpp-python leaves <think>...</think> in the content
        self._embedding = embedding
        if embedding:
            settings.update(embeddings=True, pooling=POOLING_TYPES[pooling_type])
        settings.update(_draft_settings(draft_model))
        from pyllama_spec.serving.engine import load
        from pyllama_spec.serving.token_steps import TokenSteps
        from pyllama_spec.serving.vocabulary import Vocabulary

        self._vocab_only = vocab_only
        if vocab_only:  # the vocabulary alone: tokenize and detokenize
            self._engine = Vocabulary(self.model_path, n_ctx=n_ctx or 512)
        else:
            # verbose (llama-cpp-python's default: True) prints llama.cpp's log to stderr, as there
            self._engine = load(self.model_path, verbose=verbose, **settings)
        model = self._engine.model
        self._steps = TokenSteps(self._engine)
        self._ctx = _ContextView(self._engine)
        self._is_hybrid = model.is_hybrid  # (llama-cpp-python's: the engine counts both as recurrent)
        self._is_recurrent = model.is_recurrent and not self._is_hybrid
        self._n_vocab, self._n_ctx, self.n_batch = int(model.n_vocab), self.n_ctx(), n_batch
        self._logits_all = logits_all
        self.last_n_tokens_size = last_n_tokens_size
        self.cache: BaseLlamaCache | None = None
        # what llama-cpp-python keeps of the context: the tokens decoded, and (logits_all) their logits
        self.n_tokens = 0
        self.input_ids: np.ndarray = np.ndarray((self._n_ctx,), dtype=np.intc)
        self.scores: np.ndarray = np.zeros((self._n_ctx if logits_all else n_batch, self._n_vocab), dtype=np.single)
        self._requires_eval = True  # the context's last logits are not those of input_ids[n_tokens - 1]

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to free it with
            pass

    @property
    def engine(self):
        """The pyllama_spec ``Engine`` behind this facade (its full API)."""
        self._check_can_generate()
        return self._engine

    def _check_can_generate(self) -> None:
        if self._vocab_only:
            raise ValueError("this Llama was loaded with vocab_only=True: it tokenizes and detokenizes, and has no "
                             "weights to decode with (load it without vocab_only)")

    # ------------------------------------------------------------------ the vocabulary
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return [int(t) for t in self._engine.model.tokenize(text.decode("utf-8", errors="replace"),
                                                            add_special=add_bos, parse_special=special)]

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        """The tokens' bytes, joined (a token may hold part of a UTF-8 character), as llama-cpp-python
        joins them: a leading space after a first BOS token dropped; ``prev_tokens`` not used."""
        model = self._engine.model
        tokens = [int(t) for t in tokens]
        out = b"".join(model.token_to_bytes(t, special=special) for t in tokens)
        if tokens and tokens[0] == model.bos and out[:1] == b" ":
            out = out[1:]
        return out

    def token_bos(self) -> int:
        return int(self._engine.model.bos)

    def token_eos(self) -> int:
        return int(self._engine.model.eos)

    def n_ctx(self) -> int:
        return int(self._engine.ctx.n_ctx)

    def n_vocab(self) -> int:
        return int(self._engine.model.n_vocab)

    def n_embd(self) -> int:
        return int(self._engine.model.n_embd)

    def set_seed(self, seed: int) -> None:
        self._seed = seed or LLAMA_DEFAULT_SEED  # llama-cpp-python's: 0 and None mean the default

    @property
    def metadata(self) -> dict[str, str]:
        """The GGUF's metadata, values as strings (llama-cpp-python's ``Llama.metadata``)."""
        from pyllama_spec.gguf.reader import read_gguf

        return {k: str(v) for k, v in read_gguf(self.model_path, "model").metadata.items()}

    def token_nl(self) -> int:
        return int(self._engine.model.nl)

    def tokenizer(self) -> LlamaTokenizer:
        return LlamaTokenizer(self)

    # ------------------------------------------------------------------ token by token (llama-cpp-python's low level)
    @property
    def _input_ids(self) -> np.ndarray:
        return self.input_ids[: self.n_tokens]

    @property
    def _scores(self) -> np.ndarray:
        return self.scores[: self.n_tokens, :]

    @property
    def eval_tokens(self) -> deque[int]:
        return deque(self.input_ids[: self.n_tokens].tolist(), maxlen=self._n_ctx)

    @property
    def eval_logits(self) -> deque[list[float]]:
        return deque(self.scores[: self.n_tokens, :].tolist(), maxlen=self._n_ctx if self._logits_all else 1)

    def reset(self) -> None:
        """Forget the decoded tokens: the next ``eval`` or completion decodes its prompt from the start."""
        self.n_tokens = 0
        self._requires_eval = True
        if not self._vocab_only:
            self._steps.forget()

    def eval(self, tokens: Sequence[int]) -> None:
        """Decode ``tokens`` after the ``n_tokens`` already decoded (what the context held past them is
        dropped); ``sample`` then picks from the last one's logits (every one's, with ``logits_all``)."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        self._check_can_generate()
        n_past = self.n_tokens
        rows = self._steps.eval(self.input_ids[:n_past], tokens, all_logits=self._logits_all)
        self.input_ids[n_past:n_past + len(tokens)] = tokens
        if self._logits_all:  # (rows the cache already held are not decoded again: their logits stay)
            self.scores[n_past + len(tokens) - len(rows):n_past + len(tokens)] = rows
        self.n_tokens = n_past + len(tokens)
        self._requires_eval = False

    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.80, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_eta: float = 0.1,
               mirostat_tau: float = 5.0, penalize_nl: bool = True,
               logits_processor: LogitsProcessorList | None = None, grammar: LlamaGrammar | None = None,
               idx: int | None = None) -> int:
        """A token sampled from the logits of token ``idx`` of the last ``eval`` (default: its last),
        with a sampler chain made for this call."""
        if self.n_tokens <= 0:
            raise ValueError("sample: nothing was decoded yet (call eval first)")
        if not self._steps.has_outputs:  # a load_state or a completion since: the last token's logits again
            self._refresh_last_logits()
        with self._sampler_of(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temp,
                              repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, mirostat_mode=mirostat_mode,
                              mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, grammar=grammar) as sampler:
            return sampler.sample(idx - self.n_tokens if idx is not None else -1, hooks=logits_processor or (),
                                  history=self._input_ids)

    def generate(self, tokens: Sequence[int], top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 penalize_nl: bool = True, logits_processor: LogitsProcessorList | None = None,
                 stopping_criteria: StoppingCriteriaList | None = None, grammar: LlamaGrammar | None = None
                 ) -> Generator[int, Sequence[int] | None, None]:
        """Tokens after ``tokens``, one at a time, for as long as they are read (llama-cpp-python's
        generator: what the context holds of ``tokens`` is kept, and a token sent in is decoded too).
        The target decodes one token a step here: drafting runs in the completions."""
        tokens = [int(t) for t in tokens]
        sampler = self._sampler_of(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temp,
                                   repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                                   presence_penalty=presence_penalty, mirostat_mode=mirostat_mode,
                                   mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, grammar=grammar)
        with sampler:
            if reset and self.n_tokens > 0:  # llama-cpp-python's prefix match
                longest = self.longest_token_prefix(self._input_ids.tolist(), tokens)
                consumed = longest == len(tokens)
                if consumed and self.n_tokens == len(tokens) and not self._requires_eval:
                    reset, tokens = False, []  # the last logits are this prompt's: sample at once
                else:
                    keep = longest - 1 if consumed else longest  # something is decoded, for fresh logits
                    if keep > 0:
                        reset, tokens = False, tokens[keep:]
                        self.n_tokens, self._requires_eval = keep, True
            if reset:
                self.reset()
            sample_idx = self.n_tokens + len(tokens) - 1
            while True:
                self.eval(tokens)
                while sample_idx < self.n_tokens:
                    token = sampler.sample(sample_idx - self.n_tokens, hooks=logits_processor or (),
                                           history=self._input_ids)
                    sample_idx += 1
                    if stopping_criteria is not None and stopping_criteria(
                            self._input_ids[:sample_idx], self._scores[sample_idx - self.n_tokens, :]):
                        return
                    sent = yield token
                    tokens = [token, *(int(t) for t in sent or ())]
                    if sample_idx < self.n_tokens and token != self._input_ids[sample_idx]:
                        self.n_tokens, self._requires_eval = sample_idx, True  # a sent token was not the pick
                        break

    def _refresh_last_logits(self) -> None:
        """Decode the last of ``input_ids[:n_tokens]`` again (what the slot holds before it is kept), so
        that ``sample`` reads its logits, as llama-cpp-python's restored or left-over logits."""
        n = self.n_tokens
        rows = self._steps.eval(self.input_ids[:n - 1], self.input_ids[n - 1:n], all_logits=False)
        if self._logits_all:
            self.scores[n - 1] = rows[-1]
        self._requires_eval = False

    def _sampler_of(self, *, top_k, top_p, min_p, typical_p, temp, repeat_penalty, frequency_penalty,
                    presence_penalty, mirostat_mode, mirostat_tau, mirostat_eta, grammar):
        """llama-cpp-python's sampler chain: penalties over the last ``last_n_tokens_size`` tokens, the
        grammar, then greedy (temp 0), the distribution alone (temp < 0), mirostat, or top-k, typical,
        top-p, min-p, temperature and the distribution; seeded with the Llama's seed."""
        settings = dict(repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                        presence_penalty=presence_penalty, penalty_last_n=self.last_n_tokens_size)
        if temp < 0.0:  # llama-cpp-python: the distribution, nothing before it
            settings.update(temperature=1.0, samplers=("penalties",))
        else:
            settings.update(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                            mirostat=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
                            min_keep=1)
        return self._steps.sampler(seed=self._seed & 0xFFFFFFFF, grammar=grammar._grammar if grammar else None,
                                   **settings)

    longest_token_prefix = staticmethod(longest_token_prefix)

    # ------------------------------------------------------------------ the state
    def save_state(self) -> LlamaState:
        """What the context holds (its memory, the tokens decoded, their logits) and the seed."""
        self._check_can_generate()
        saved = self._steps.save()
        # without logits_all no row of scores is ever written: a copy of those zeros would cost n_tokens x
        # n_vocab floats a state (300 MB at 512 tokens of a 150k vocabulary), so a state keeps none
        scores = self._scores.copy() if self._logits_all else self.scores[:0].copy()
        return LlamaState(input_ids=self.input_ids.copy(), scores=scores, n_tokens=self.n_tokens,
                          llama_state=saved.memory, llama_state_size=len(saved.memory), seed=self._seed,
                          saved=saved)

    def load_state(self, state: LlamaState) -> None:
        """Put back a ``save_state``'s state (of this model, with the same cache types): the next
        ``generate`` or completion decodes again from where it ends (for fresh logits, at least the last
        token). ``KVMemoryError`` when the context refuses it; the context is then empty."""
        saved = getattr(state, "saved", None)
        try:
            if saved is None:  # a LlamaState made by hand: its tokens and memory image
                self._steps.restore_tokens(state.input_ids[:state.n_tokens], bytes(state.llama_state))
            else:
                self._steps.restore(saved)
        except BaseException:
            self.n_tokens, self._requires_eval = 0, True
            raise
        self.scores[: len(state.scores), :] = state.scores
        self.input_ids = state.input_ids.copy()
        self.n_tokens = state.n_tokens
        self._requires_eval = True
        self._seed = state.seed

    def set_cache(self, cache: BaseLlamaCache | None) -> None:
        """Keep each completion's state in ``cache`` (LlamaRAMCache, LlamaDiskCache), keyed by its tokens;
        a completion whose prompt starts with more of a kept state's tokens than the context holds starts
        from that state (``load_state``)."""
        self.cache = cache

    @contextlib.contextmanager
    def _engine_run(self):
        """Around a generation the engine runs on the slot: afterwards ``input_ids`` / ``n_tokens`` say
        what the slot holds, and with a cache set its state is kept there (llama-cpp-python keeps each
        completion's). A generation that did not end (an error, a stream left early) leaves nothing
        to reuse on this side: the next ``generate`` decodes its prompt again."""
        self._steps.drop_outputs()
        self._requires_eval = True
        ended = False
        try:
            yield
            ended = True
        finally:
            self.n_tokens = 0
            if ended:
                self._read_back_the_slot()

    def _read_back_the_slot(self) -> None:
        # (the engine keeps no logits of the rows it decoded: with logits_all, ``scores`` is filled by
        # eval and generate only)
        held = self._steps.held()
        if held is None:  # a picture's rows are not tokens: nothing to match
            return
        self.input_ids[: len(held)] = held
        self.n_tokens = len(held)
        if self.cache is not None and self.n_tokens:
            self.cache[self._input_ids.tolist()] = self.save_state()

    def _prompt_tokens(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's tokens as llama-cpp-python makes them (special tokens parsed, BOS added)."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        return self.tokenize(prompt.encode("utf-8"), special=True) if prompt else [self.token_bos()]

    def _start_from_cache(self, prompt_tokens: list[int]) -> None:
        """llama-cpp-python's cache lookup: the kept state that shares the longest prefix with the
        prompt, loaded when that prefix is longer than what the context holds of it."""
        try:
            item = self.cache[prompt_tokens]
        except KeyError:
            return
        cached = self.longest_token_prefix(item.input_ids[: item.n_tokens].tolist(), prompt_tokens)
        if cached > self.longest_token_prefix(self._input_ids.tolist(), prompt_tokens):
            self.load_state(item)

    def _token_completion(self, prompt: str | Sequence[int], prompt_tokens: list[int], head: dict, *, max_tokens,
                          stop, stream, seed, echo, logprobs, logit_bias, stopping_criteria, sampling: dict):
        """A completion through ``generate``, token by token (a ``logits_processor`` or
        ``stopping_criteria`` runs Python at each token): llama-cpp-python's loop, with its stop
        strings, its end-of-generation tokens, its finish reasons and its chunks."""
        if logprobs is not None:
            raise NotImplementedError("logprobs with logits_processor or stopping_criteria: pyllama_spec.llama_cpp "
                                      "gives logprobs from the engine's completions (without those hooks)")
        room = self._n_ctx - len(prompt_tokens)
        if room <= 0:
            raise ValueError(f"Requested tokens ({len(prompt_tokens)}) exceed context window of {self._n_ctx}")
        max_tokens = room if max_tokens is None or max_tokens <= 0 else min(max_tokens, room)
        if logit_bias:  # llama-cpp-python applies it as a logits processor too
            bias = {int(t): float(b) for t, b in logit_bias.items()}

            def add_bias(_ids, logits):
                for t, b in bias.items():
                    logits[t] += b
                return logits

            sampling = dict(sampling, logits_processor=LogitsProcessorList([add_bias, *sampling["logits_processor"]]))
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        eog = set(self._engine.model.eog_tokens)
        prompt_text = prompt if isinstance(prompt, str) else self.detokenize(prompt_tokens).decode("utf-8", "ignore")

        def pieces():  # (text that may be shown now, (finish reason, tokens) at the end)
            if self.cache is not None:
                self._start_from_cache(prompt_tokens)
            self.set_seed(seed if seed is not None else random.Random(self._seed).randint(0, 2**32))
            # the engine's own text assembly: partial characters and possible stop strings held back
            text = TextAssembler(self._engine.model, stops)
            out: list[int] = []
            finish = "length"
            tokens = self.generate(prompt_tokens, stopping_criteria=stopping_criteria, **sampling)
            with contextlib.closing(tokens):
                for token in tokens:
                    if token in eog:
                        finish = "stop"
                        break
                    out.append(token)
                    shown, stopped = text.push([token])
                    if shown:
                        yield shown, None
                    if stopped:
                        finish = "stop"
                        break
                    if len(out) >= max_tokens:
                        break
                else:
                    finish = "stop"  # generate ended: the stopping criteria said so
            yield text.flush(), (finish, len(out))
            if self.cache is not None:
                self.cache[prompt_tokens + out] = self.save_state()

        if stream:
            def chunks():
                for text, end in pieces():
                    if text:
                        yield dict(head, choices=[dict(text=text, index=0, logprobs=None, finish_reason=None)])
                    if end is not None:
                        yield dict(head, choices=[dict(text="", index=0, logprobs=None, finish_reason=end[0])])
            return chunks()
        texts, end = [prompt_text] if echo else [], None
        for text, end in pieces():
            texts.append(text)
        return dict(head, choices=[dict(text="".join(texts), index=0, logprobs=None, finish_reason=end[0])],
                    usage=_usage_of(len(prompt_tokens), end[1]))

    # ------------------------------------------------------------------ embeddings
    def pooling_type(self) -> int:
        """How embeddings pool a prompt's rows (llama.cpp's ids: 0 none, 1 mean, 2 cls, 3 last, 4 rank)."""
        self._check_can_generate()
        return next((k for k, v in POOLING_TYPES.items() if v == self._engine.pooling), -1)

    def create_embedding(self, input: str | list[str], model: str | None = None) -> T.CreateEmbeddingResponse:
        """OpenAI's embedding response of ``input`` (not normalised, as llama-cpp-python's)."""
        inputs = input if isinstance(input, list) else [input]
        embeds, total_tokens = self.embed(inputs, return_count=True)
        return {"object": "list", "data": [{"object": "embedding", "embedding": e, "index": i}
                                          for i, e in enumerate(embeds)],
                "model": model if model is not None else self.model_path,
                "usage": {"prompt_tokens": total_tokens, "total_tokens": total_tokens}}

    def embed(self, input: str | list[str], normalize: bool = False, truncate: bool = True,
              return_count: bool = False):
        """The embedding of a string (a list of floats; a list per token with pooling none), or of each
        string of a list; ``normalize``: to unit length; ``truncate``: a text's tokens past n_batch are
        dropped (else ValueError); ``return_count``: (embeddings, tokens embedded). Each text runs on the
        engine's slot (what it held is forgotten, as ``reset()``)."""
        self._check_can_generate()
        if not self._embedding:
            raise RuntimeError("Llama model must be created with embedding=True to call this method")
        from pyllama_spec.serving.embeddings import EmbeddingInput

        texts = [input] if isinstance(input, str) else list(input)
        prompts = []
        for text in texts:
            tokens = self.tokenize(text.encode("utf-8"))
            if truncate:
                tokens = tokens[:self.n_batch]
            if len(tokens) > self.n_batch:
                raise ValueError(f"Requested tokens ({len(tokens)}) exceed batch size of {self.n_batch}")
            prompts.append(EmbeddingInput((np.asarray(tokens, dtype=np.int32),)))
        self.reset()  # the slot's tokens go (each embedding decodes its own from position 0)
        results = self._engine.embed(prompts, normalize=2 if normalize else -1)
        if normalize:  # llama-cpp-python normalises each row's vector too, with pooling none
            unit = [e.vectors / np.maximum(np.linalg.norm(e.vectors, axis=1, keepdims=True), 1e-30)
                    if not e.pooled else e.vectors for e in results]
        else:
            unit = [e.vectors for e in results]
        data = [v.tolist() if not e.pooled else v[0].tolist() for e, v in zip(results, unit)]
        output = data[0] if isinstance(input, str) else data
        return (output, sum(e.n_tokens for e in results)) if return_count else output

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str | None, additional_files: list | None = None,
                        local_dir: str | os.PathLike[str] | None = None, local_dir_use_symlinks: Any = "auto",
                        cache_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> "Llama":
        """A ``Llama`` of ``repo_id``'s file matching ``filename`` (a name or a glob), downloaded from the
        Hugging Face Hub as llama-cpp-python downloads it (``hub.hub_model_path``; the huggingface-hub
        package, as there); ``kwargs`` go to ``Llama``."""
        from pyllama_spec.llama_cpp.hub import hub_model_path

        return cls(model_path=hub_model_path(repo_id, filename, additional_files, local_dir, local_dir_use_symlinks,
                                             cache_dir), **kwargs)

    # ------------------------------------------------------------------ completions
    def create_completion(self, prompt: str | list[int], suffix: str | None = None, max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, min_p: float = 0.05,
                          typical_p: float = 1.0, logprobs: int | None = None, echo: bool = False,
                          stop: str | list[str] | None = None, frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0, repeat_penalty: float = 1.0, top_k: int = 40,
                          stream: bool = False, seed: int | None = None, tfs_z: float = 1.0, mirostat_mode: int = 0,
                          mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: str | None = None,
                          stopping_criteria: StoppingCriteriaList | None = None,
                          logits_processor: LogitsProcessorList | None = None, grammar: LlamaGrammar | None = None,
                          logit_bias: dict[int, float] | None = None
                          ) -> T.CreateCompletionResponse | Iterator[T.CreateCompletionStreamResponse]:
        """Complete ``prompt`` (text, or token ids). Streamed: llama-cpp-python's chunks, the last with
        its ``finish_reason``."""
        self._check_can_generate()
        head = dict(id=f"cmpl-{uuid.uuid4()}", object="text_completion", created=int(time.time()),
                    model=model or self.model_path)
        appended = ""  # a suffix the model cannot take in: added after the answer, as llama-cpp-python does
        if suffix is not None:
            fim = self._fim_prompt(prompt, suffix)
            if fim is None:
                appended = suffix
            else:
                if echo:  # the echo is the prompt as given, not the FIM layout
                    raise NotImplementedError("echo with suffix: pyllama_spec.llama_cpp echoes no FIM prompt")
                prompt = fim
        if stopping_criteria or logits_processor:  # Python per token: llama-cpp-python's own loop
            done = self._token_completion(
                prompt, self._prompt_tokens(prompt), head, max_tokens=max_tokens, stop=stop, stream=stream, seed=seed,
                echo=echo, logprobs=logprobs, logit_bias=logit_bias, stopping_criteria=stopping_criteria,
                sampling=dict(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temperature,
                              repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, mirostat_mode=mirostat_mode,
                              mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, grammar=grammar,
                              logits_processor=logits_processor))
            if appended and stream:
                return _then_text(done, head, appended)
            if appended:
                done["choices"][0]["text"] += appended
            return done
        if self.cache is not None:
            self._start_from_cache(self._prompt_tokens(prompt))
        if isinstance(prompt, str):
            text_prompt = prompt
        else:
            text_prompt = (np.asarray(prompt, dtype=np.int32),)
        options = self._options(max_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p,
                                typical_p=typical_p, stop=stop, frequency_penalty=frequency_penalty,
                                presence_penalty=presence_penalty, repeat_penalty=repeat_penalty, top_k=top_k,
                                seed=seed, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
                                mirostat_eta=mirostat_eta, grammar=grammar, logit_bias=logit_bias,
                                logprobs=logprobs)
        prompt_text = prompt if isinstance(prompt, str) else self.detokenize(prompt).decode("utf-8", errors="replace")
        pieces = self._engine.stream(text_prompt, **options)
        if stream:  # llama-cpp-python streams no echo
            chunks = self._completion_chunks(pieces, head, len(prompt_text), logprobs)
            return _then_text(chunks, head, appended) if appended else chunks
        out = self._completion(pieces, head, prompt_text if echo else "", len(prompt_text), logprobs)
        out["choices"][0]["text"] += appended
        return out

    __call__ = create_completion

    def _fim_prompt(self, prompt: str | Sequence[int], suffix: str) -> list[int] | None:
        """The fill-in-the-middle prompt with the model's FIM tokens: [BOS] <pre> prompt <suf> suffix <mid>
        (``spm_infill``: the suffix part first), as llama.cpp's infill lays it out; None for a model
        without them. (llama-cpp-python 0.3.36 meant this; its token ids are placeholders there.)"""
        fim = self._engine.model.fim_tokens
        if min(fim["pre"], fim["suf"], fim["mid"]) < 0:
            return None
        text = self.tokenize(prompt.encode("utf-8"), add_bos=False) if isinstance(prompt, str) else list(prompt)
        pre = [fim["pre"], *text]
        suf = [fim["suf"], *self.tokenize(suffix.encode("utf-8"), add_bos=False)]
        bos = [self.token_bos()] if self._engine.model.add_bos and self.token_bos() >= 0 else []
        return bos + (suf + pre if self.spm_infill else pre + suf) + [fim["mid"]]

    def _completion(self, pieces, head: dict, echoed: str, prompt_chars: int,
                    logprobs: int | None) -> T.CreateCompletionResponse:
        text, entries, last = [echoed], [], None
        with self._engine_run(), contextlib.closing(pieces):
            for piece in pieces:
                text.append(piece.text)
                if logprobs is not None:
                    entries.extend(_token_entries(self, piece))
                last = piece
        stats = last.stats
        # llama-cpp-python: offsets count from the start of the prompt (0 with echo, whose prompt tokens
        # it also lists; this engine gives no prompt logprobs, so those are not listed)
        lp = _completion_logprobs(entries, len(echoed) if echoed else prompt_chars) if logprobs is not None else None
        return dict(head, choices=[dict(text="".join(text), index=0, logprobs=lp,
                                        finish_reason=last.finish_reason or "stop")],
                    usage=_usage(stats), speculative=stats.as_dict())

    def _completion_chunks(self, pieces, head: dict, offset: int, logprobs: int | None):
        """llama-cpp-python's stream: the text as it comes, then an empty chunk with the finish reason
        (and, this project's, the drafting statistics)."""
        pending: list = []  # logprobs of tokens whose text the engine holds back (a partial character, a
        # possible stop string): they go with the next chunk that has text
        with self._engine_run(), contextlib.closing(pieces):  # a consumer that stops early ends the generation
            for piece in pieces:
                if logprobs is not None:
                    pending.extend(_token_entries(self, piece))
                if piece.text:
                    lp = _completion_logprobs(pending, offset) if logprobs is not None else None
                    offset += sum(len(e[0]) for e in pending) if logprobs is not None else len(piece.text)
                    pending = []
                    yield dict(head, choices=[dict(text=piece.text, index=0, logprobs=lp, finish_reason=None)])
                if piece.stats is not None:
                    yield dict(head, choices=[dict(text="", index=0,
                                                   logprobs=_completion_logprobs(pending, offset) if pending else None,
                                                   finish_reason=piece.finish_reason or "stop")],
                               speculative=piece.stats.as_dict())

    # ------------------------------------------------------------------ chats
    def create_chat_completion(self, messages: list[T.ChatCompletionRequestMessage], functions: Any = None,
                               function_call: Any = None, tools: list[T.ChatCompletionTool] | None = None,
                               tool_choice: Any = None, temperature: float = 0.2, top_p: float = 0.95,
                               top_k: int = 40, min_p: float = 0.05, typical_p: float = 1.0, stream: bool = False,
                               stop: str | list[str] | None = None, seed: int | None = None,
                               response_format: T.ChatCompletionRequestResponseFormat | None = None,
                               max_tokens: int | None = None, presence_penalty: float = 0.0,
                               frequency_penalty: float = 0.0, repeat_penalty: float = 1.0, tfs_z: float = 1.0,
                               mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                               model: str | None = None, logits_processor: LogitsProcessorList | None = None,
                               grammar: LlamaGrammar | None = None, logit_bias: dict[int, float] | None = None,
                               logprobs: bool | None = None, top_logprobs: int | None = None
                               ) -> T.CreateChatCompletionResponse | Iterator[T.CreateChatCompletionStreamResponse]:
        """Answer a chat: text and ``image_url`` parts (with a ``chat_handler``), ``tools`` /
        ``tool_choice``, ``response_format`` (``json_object``, with or without a ``schema``).
        Through the model's template (``MTMDChatHandler`` or none), the answer's tool calls parsed as
        llama-server parses them; through a Llava-style handler's own template, or a named
        ``chat_format`` (and no ``chat_handler``), as llama-cpp-python answers it: the prompt rendered,
        completed (``chat_formats.answer_as_completion``)."""
        from pyllama_spec.serving.chat_template import ChatOptions

        self._check_can_generate()
        # llama-cpp-python's own ways (a Llava-style handler's template, a named format) take these as they are
        answer = dict(functions=functions, function_call=function_call, tools=tools, tool_choice=tool_choice,
                      stop=stop, response_format=response_format, grammar=grammar, logprobs=logprobs,
                      top_logprobs=top_logprobs, stream=stream)
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, typical_p=typical_p,
                        seed=seed, max_tokens=max_tokens, presence_penalty=presence_penalty,
                        frequency_penalty=frequency_penalty, repeat_penalty=repeat_penalty, tfs_z=tfs_z,
                        mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
                        model=model, logits_processor=logits_processor, logit_bias=logit_bias)
        if isinstance(self.chat_handler, Llava15ChatHandler):  # its own template, answered as a completion
            text, urls = self.chat_handler.render(messages, bos_token=self._special_text(self.token_bos()),
                                                  eos_token=self._special_text(self.token_eos()))
            images = [load_image(url) for url in urls]

            def complete(**options: Any):
                return self._completion_with_images(text, images, **options)

            return chat_formats.answer_as_completion(complete, **answer, **sampling)
        if self.chat_handler is None and not chat_formats.uses_the_models_template(self.chat_format):
            return chat_formats.formatted_chat_completion(
                self, chat_formats.get_chat_formatter(self.chat_format), messages=messages, **answer, **sampling)
        if functions is not None or function_call is not None:
            tools = [{"type": "function", "function": f} for f in functions or []] or tools
            if isinstance(function_call, dict):
                tool_choice = {"type": "function", "function": {"name": function_call["name"]}}
            elif function_call is not None:
                tool_choice = function_call
        schema = None
        if response_format is not None and response_format.get("type") == "json_object":
            schema = response_format.get("schema") or {}
        if schema is not None and grammar is not None:
            raise ValueError("give grammar= or response_format with a schema, not both")
        chat = self._engine.chat_params(self._messages(messages), ChatOptions(
            tools=tools or None, tool_choice=tool_choice or "auto", json_schema=schema,
            grammar=grammar._grammar if grammar is not None else None))
        options = self._options(max_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p,
                                typical_p=typical_p, stop=stop, frequency_penalty=frequency_penalty,
                                presence_penalty=presence_penalty, repeat_penalty=repeat_penalty, top_k=top_k,
                                seed=seed, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
                                mirostat_eta=mirostat_eta, grammar=None, logit_bias=logit_bias,
                                logprobs=top_logprobs if logprobs else None)
        head = dict(id=f"chatcmpl-{uuid.uuid4()}", created=int(time.time()), model=model or self.model_path)
        if logits_processor:  # Python per token: the rendered chat through llama-cpp-python's own loop
            if chat.images or chat.grammar:
                raise NotImplementedError("logits_processor in a chat with pictures, tools or a response format: "
                                          "pyllama_spec.llama_cpp runs those through the engine's sampler (use "
                                          "grammar=, logit_bias= and the sampler options there)")
            done = self._token_completion(
                chat.prompt, self._prompt_tokens(chat.prompt), {}, max_tokens=max_tokens,
                stop=[*([stop] if isinstance(stop, str) else stop or ()), *chat.additional_stops], stream=stream,
                seed=seed, echo=False, logprobs=None, logit_bias=logit_bias, stopping_criteria=None,
                sampling=dict(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temperature,
                              repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, mirostat_mode=mirostat_mode,
                              mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, grammar=grammar,
                              logits_processor=logits_processor))
            return self._chat_of_completion(done, chat, head, stream)
        pieces = self._engine.stream(chat=chat, **options)
        with_logprobs = bool(logprobs) and top_logprobs is not None  # llama-cpp-python: both, or none
        if stream:
            return self._chat_chunks(pieces, chat, head, with_logprobs)
        return self._chat(pieces, chat, head, with_logprobs)

    def _completion_with_images(self, text: str, images: list, *, stop, stream: bool, grammar, logprobs,
                                max_tokens, temperature, top_p, top_k, min_p, typical_p, seed, presence_penalty,
                                frequency_penalty, repeat_penalty, tfs_z, mirostat_mode, mirostat_tau, mirostat_eta,
                                model, logits_processor, logit_bias) -> Any:
        """``create_completion`` of a prompt whose media markers stand for ``images`` (a Llava-style
        handler's rendered chat), in its shapes (``tfs_z`` is taken and unused, as there)."""
        if logits_processor:
            raise NotImplementedError("logits_processor in a chat with pictures: pyllama_spec.llama_cpp runs those "
                                      "through the engine's sampler (use grammar=, logit_bias= and the sampler "
                                      "options there)")
        head = dict(id=f"cmpl-{uuid.uuid4()}", object="text_completion", created=int(time.time()),
                    model=model or self.model_path)
        options = self._options(max_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p,
                                typical_p=typical_p, stop=stop, frequency_penalty=frequency_penalty,
                                presence_penalty=presence_penalty, repeat_penalty=repeat_penalty, top_k=top_k,
                                seed=seed, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
                                mirostat_eta=mirostat_eta, grammar=grammar, logit_bias=logit_bias, logprobs=logprobs)
        pieces = self._engine.stream(text, images=images, **options)
        if stream:
            return self._completion_chunks(pieces, head, len(text), logprobs)
        return self._completion(pieces, head, "", len(text), logprobs)

    def _special_text(self, token: int) -> str:
        """A special token's text (a template's bos_token / eos_token), or "" where the model has none."""
        return self.detokenize([token], special=True).decode("utf-8", errors="replace") if token >= 0 else ""

    def _chat_of_completion(self, done, chat, head: dict, stream: bool):
        """A token-by-token completion of a rendered chat (``_token_completion``) as the chat's answer:
        its text read by the chat's parser, in llama-cpp-python's chat shapes."""
        answer = _Answer(chat, stream=stream)
        if not stream:
            first = done["choices"][0]
            answer.feed(first["text"], final=True)
            return dict(head, object="chat.completion", usage=done["usage"],
                        choices=[dict(index=0, message=answer.llama_message(), logprobs=None,
                                      finish_reason=answer.finish_reason(first["finish_reason"]))])

        def chunks():
            def chunk(delta: dict, finish=None) -> dict:
                return dict(head, object="chat.completion.chunk",
                            choices=[dict(index=0, delta=delta, finish_reason=finish, logprobs=None)])

            yield chunk({"role": "assistant"})
            for c in done:
                first = c["choices"][0]
                finish = first["finish_reason"]
                for delta in answer.feed(first["text"], final=finish is not None):
                    yield chunk(delta)
                if finish is not None:
                    yield chunk({}, answer.finish_reason(finish))
        return chunks()

    def _messages(self, messages: list) -> list:
        """The messages with each ``image_url`` as a picture the engine reads (bytes or a local path)."""
        out = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list) and any(p.get("type") == "image_url" for p in content):
                if self.chat_handler is None:
                    raise ValueError("a message has an image_url part, but this Llama has no chat_handler "
                                     "(its projector): Llama(..., chat_handler=MTMDChatHandler(clip_model_path=...))")
                parts = []
                for p in content:
                    if p.get("type") == "image_url":
                        url = p["image_url"]["url"] if isinstance(p["image_url"], dict) else p["image_url"]
                        p = {"type": "image", "image": load_image(url)}
                    parts.append(p)
                m = dict(m, content=parts)
            out.append(m)
        return out

    def _chat(self, pieces, chat, head: dict, logprobs: bool) -> T.CreateChatCompletionResponse:
        answer = _Answer(chat, stream=False)
        text, entries, last = [], [], None
        with self._engine_run(), contextlib.closing(pieces):
            for piece in pieces:
                text.append(piece.text)
                if logprobs:
                    entries.extend(_token_entries(self, piece))
                last = piece
        answer.feed("".join(text), final=True)  # the whole answer, parsed once (as the server's route)
        return dict(head, object="chat.completion",
                    choices=[dict(index=0, message=answer.llama_message(),
                                  finish_reason=answer.finish_reason(last.finish_reason or "stop"),
                                  logprobs=_chat_logprobs(entries) if logprobs else None)],
                    usage=_usage(last.stats), speculative=last.stats.as_dict())

    def _chat_chunks(self, pieces, chat, head: dict, logprobs: bool):
        """llama-cpp-python's chat stream: the role first, a delta a chunk, then an empty delta with the
        finish reason (and, this project's, the drafting statistics)."""
        answer = _Answer(chat, stream=True)

        def chunk(delta: dict, finish=None, lp=None) -> dict:
            return dict(head, object="chat.completion.chunk",
                        choices=[dict(index=0, delta=delta, finish_reason=finish, logprobs=lp)])

        pending: list = []  # logprobs of tokens no delta has carried yet (text the parser holds back)
        with self._engine_run(), contextlib.closing(pieces):
            yield chunk({"role": "assistant"})
            for piece in pieces:
                done = piece.stats is not None
                deltas = answer.feed(piece.text, final=done)
                if logprobs:
                    pending.extend(_token_entries(self, piece))
                for delta in deltas:
                    yield chunk(delta, lp=_chat_logprobs(pending) if pending else None)
                    pending = []
                if done:
                    lp = _chat_logprobs(pending) if pending else None
                    last = chunk({}, answer.finish_reason(piece.finish_reason or "stop"), lp=lp)
                    last["speculative"] = piece.stats.as_dict()
                    yield last

    # ------------------------------------------------------------------ the request
    def _options(self, *, max_tokens, temperature, top_p, min_p, typical_p, stop, frequency_penalty,
                 presence_penalty, repeat_penalty, top_k, seed, mirostat_mode, mirostat_tau, mirostat_eta, grammar,
                 logit_bias, logprobs) -> dict[str, Any]:
        """llama-cpp-python's call options as the engine's request options."""
        if max_tokens is None or max_tokens <= 0:  # llama-cpp-python: until the context is full
            max_tokens = self.n_ctx()
        # llama-cpp-python's seed chain: a given seed stays the Llama's; otherwise each call draws the next
        # seed from the last, so a run is the same from process to process
        self.set_seed(seed if seed is not None else random.Random(self._seed).randint(0, 2**32))
        out: dict[str, Any] = dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p, typical_p=typical_p,
            top_k=top_k, repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, seed=self._seed & 0xFFFFFFFF, stop=[stop] if isinstance(stop, str) else list(stop or ()),
            mirostat=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta)
        if grammar is not None:
            out["grammar"] = grammar._grammar
        if logit_bias:
            out["logit_bias"] = tuple((int(t), float(b)) for t, b in logit_bias.items())
        if logprobs is not None:
            out["logprobs"] = int(logprobs)
        return out


LlamaTokenizer._vocabulary_of = staticmethod(lambda path: Llama(model_path=path, vocab_only=True, verbose=False))


# ---------------------------------------------------------------------- helpers

def _trained_context(model_path: str) -> int:
    """n_ctx=0: the model's own context length (llama-cpp-python's meaning)."""
    from pyllama_spec.gguf.reader import read_gguf

    info = read_gguf(model_path, "model")
    return int(info.metadata.get(f"{info.arch}.context_length", 4096))


def _draft_settings(draft_model: LlamaDraftModel | None) -> dict[str, Any]:
    if draft_model is None:
        return {"spec_type": "none"}
    if not isinstance(draft_model, EngineDraft):  # a draft model of your own: the engine calls it each step
        if not callable(draft_model):
            raise TypeError(f"draft_model must be a LlamaDraftModel (input_ids -> token ids), got "
                            f"{type(draft_model).__name__}")
        return {"spec_type": "draft-python", "draft_callable": draft_model}
    return draft_model.engine_settings()


def _then_text(chunks, head: dict, text: str):
    """A completion stream with ``text`` sent before its last chunk (the one with the finish reason)."""
    last = None
    for chunk in chunks:
        if last is not None:
            yield last
        last = chunk
    if last is not None:
        yield dict(head, choices=[dict(text=text, index=0, logprobs=None, finish_reason=None)])
        yield last


def _usage(stats) -> T.CompletionUsage:
    return _usage_of(stats.prompt_tokens, stats.generated_tokens)


def _usage_of(prompt_tokens: int, completion_tokens: int) -> T.CompletionUsage:
    return dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens)


def _token_entries(llama: Llama, piece) -> list[tuple[str, float, dict[str, float]]]:
    """(token text, its logprob, {top token text: logprob}) for each token of a piece, as
    llama-cpp-python lists them: the token's own text and logprob among the top ones too."""
    out = []
    for lp in piece.logprobs:
        text = llama.detokenize([lp.token]).decode("utf-8", errors="ignore")  # the token's own, as there
        top = {llama.detokenize([t]).decode("utf-8", errors="ignore"): float(v) for t, v in lp.top}
        top[text] = float(lp.logprob)
        out.append((text, float(lp.logprob), top))
    return out


def _completion_logprobs(entries, offset: int) -> T.CompletionLogprobs:
    text_offset, at = [], offset
    for text, _, _ in entries:
        text_offset.append(at)
        at += len(text)
    return dict(tokens=[e[0] for e in entries], text_offset=text_offset, token_logprobs=[e[1] for e in entries],
                top_logprobs=[e[2] for e in entries])


def _chat_logprobs(entries) -> T.ChatCompletionLogprobs:
    return dict(content=[dict(token=text, logprob=lp, bytes=None,
                              top_logprobs=[dict(token=t, logprob=v, bytes=None) for t, v in top.items()])
                         for text, lp, top in entries], refusal=None)


class _Answer(ChatAnswer):
    """One chat answer parsed as it comes, as the server's chat route parses it (serving/chat_answer.py),
    given in llama-cpp-python's message shape."""

    def llama_message(self) -> dict:
        """The parsed message in llama-cpp-python's shape (its legacy ``function_call`` too)."""
        m = self.message
        out = {"role": "assistant", "content": m.get("content") or (None if m.get("tool_calls") else "")}
        if m.get("tool_calls"):
            out["tool_calls"] = m["tool_calls"]
            first = m["tool_calls"][0].get("function", {})  # llama-cpp-python's legacy field too
            out["function_call"] = {"name": first.get("name", ""), "arguments": first.get("arguments", "")}
        if m.get("reasoning_content"):
            out["reasoning_content"] = m["reasoning_content"]
        return out



def _not_yet(what: str) -> NotImplementedError:
    return NotImplementedError(f"{what}: not in pyllama_spec.llama_cpp yet (docs/llama_cpp.md)")


def _split_mode(split_mode: int) -> str:
    if split_mode not in _SPLIT_MODES:
        raise ValueError(f"split_mode={split_mode}: llama.cpp's split modes are {_SPLIT_MODES}")
    return _SPLIT_MODES[split_mode]
