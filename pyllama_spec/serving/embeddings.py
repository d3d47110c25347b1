"""Embeddings of prompts, as llama-server's ``--embeddings`` serves them and llama-cpp-python's
``Llama.embed`` returns them: each prompt's rows decoded with the context's output embeddings on,
pooled into one vector (or a vector per row with pooling "none"), then normalised.

A prompt runs on one of the engine's slots (``Engine.run_on_slot``), between the generations of
the others, as llama-server runs an embedding task in a slot: the slot's cached prompt is
forgotten, its prompt decoded from position 0, and the slot left empty. Text and pictures both go
in (a vision model embeds a picture's rows beside the text's).

How the pooled vector comes out of several decodes. llama.cpp pools the rows of one ubatch, so a
prompt longer than a ubatch (or one with a picture, whose rows are a decode of their own) is
decoded in slices of at most n_ubatch rows, each a decode, and the slices' pooled vectors combine
exactly: "mean" is their mean weighted by rows, "cls" the first slice's (its first row), "last"
and a causal "rank" the last slice's. A model without memory (an encoder such as BERT) sees its
prompt only within one decode: there the prompt must fit one ubatch, and a longer one is refused
with llama-server's words ("input (N tokens) is too large to process. increase the physical batch
size"). llama-server pools each decode alone, so its "mean" over a picture is the mean of the last
slice; here it is the prompt's.

    with EmbeddingJob(engine, [EmbeddingInput("hello")]) as job:
        embedding = engine.run_on_slot(0, job.prompt(0)).result()

A reranker (pooling "rank": a classifier head over the pair) scores documents for a query
(``EmbeddingJob.rerank``): each pair's tokens are ``RerankPairs``', and its embedding is the
classifier's output.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence as Seq

import numpy as np

from pyllama_spec.bindings.mtmd import MEDIA_MARKER, Bitmap
from pyllama_spec.errors import ContextOverflowError, ImageError
from pyllama_spec.serving.prompt_parts import EMPTY_PROMPT
from pyllama_spec.speculative.sequence import Sequence, rows_of
from pyllama_spec.speculative.stats import GenerationStats


@dataclasses.dataclass(frozen=True)
class EmbeddingInput:
    """One prompt to embed: ``text`` (the media marker where each image goes; images without
    markers go first) or a mixed prompt (a tuple of strings and int32 token arrays), and its
    images (encoded bytes, paths or PIL images, as a generation takes them)."""

    text: str | tuple
    images: tuple = ()


@dataclasses.dataclass(frozen=True)
class Embedding:
    """One prompt's embedding: ``vectors`` float32 [1, n_embd_out] when pooled (the classifier's
    scores [1, n_cls_out] with pooling "rank"), [rows, n_embd_out] with pooling "none";
    ``n_tokens`` the rows the prompt took (llama-server's tokens_evaluated)."""

    vectors: np.ndarray
    n_tokens: int
    pooling: str
    n_decodes: int = 1  # the decodes its rows took (a picture is one of its own; a long text, a slice each)

    @property
    def pooled(self) -> bool:
        return self.pooling != "none"


@dataclasses.dataclass(frozen=True)
class Rank:
    """A reranker's score of one document for a query (its classifier's first output, as llama-server
    reports it), and the rows the pair took."""

    score: float
    n_tokens: int


class RerankPairs:
    """The tokens a reranker reads for (query, document), as llama-server's ``format_prompt_rerank``
    makes them: the GGUF's "rerank" template with {query} and {document} filled in, else BOS, the
    query, EOS (or SEP), SEP, the document, EOS, each special token as the vocabulary adds them. The
    query is tokenized once, for every document."""

    def __init__(self, model: Any, query: str) -> None:
        self.model, self.query = model, query
        self.template = model.named_template("rerank")
        query_tokens = model.tokenize(query, add_special=False, parse_special=False)
        self.query_rows = len(query_tokens)  # what the query alone takes of a pair
        if self.template is None:
            eos = model.eos if model.eos != -1 else model.sep
            head = [[model.bos]] if model.add_bos else []
            head.append(query_tokens)
            if model.add_eos:
                head.append([eos])
            if model.add_sep:
                head.append([model.sep])
            self._head = np.concatenate([np.asarray(p, dtype=np.int32) for p in head])
            self._tail = np.asarray([eos] if model.add_eos else [], dtype=np.int32)

    def tokens(self, document: str) -> np.ndarray:
        if self.template is not None:
            prompt = self.template.replace("{query}", self.query).replace("{document}", document)
            return self.model.tokenize(prompt, add_special=False, parse_special=True)
        doc = self.model.tokenize(document, add_special=False, parse_special=False)
        return np.concatenate([self._head, np.asarray(doc, dtype=np.int32), self._tail])


def rerank_tokens(model: Any, query: str, document: str) -> np.ndarray:
    """The tokens of one (query, document) pair (``RerankPairs``)."""
    return RerankPairs(model, query).tokens(document)


def normalize(vector: np.ndarray, kind: int) -> np.ndarray:
    """llama.cpp's ``common_embd_normalize``: -1 none, 0 scaled so the largest |value| is 32760
    (an int16 range), 1 taxicab, 2 euclidean, >2 that p-norm. A zero vector stays zero."""
    v = np.asarray(vector, dtype=np.float64)
    if kind == -1:
        total = 1.0
    elif kind == 0:
        total = float(np.abs(v).max(initial=0.0)) / 32760.0
    elif kind == 2:
        total = float(np.sqrt(np.sum(v * v)))
    else:
        total = float(np.sum(np.abs(v) ** kind) ** (1.0 / kind))
    return (v * (1.0 / total if total > 0 else 0.0)).astype(np.float32)


class EmbeddingJob:
    """Prompts made ready to embed (tokenized, their images loaded) on an engine; calling it with a
    slot's ``Sequence`` (in the slot loop) decodes them and returns their ``Embedding`` s. Close it
    when done (it holds the images' bitmaps).

    ValueError when the engine was not loaded for embeddings, or a prompt is empty or cannot be
    decoded whole where it must be (see the module); ContextOverflowError when a prompt does not
    fit a slot's share of the context."""

    def __init__(self, engine: Any, inputs: Iterable[EmbeddingInput], *, normalize: int | None = None) -> None:
        config = engine.config
        if not config.embeddings:
            raise ValueError("this engine was not loaded for embeddings: load it with embeddings=True "
                             "(llama-server's --embeddings)")
        self.engine = engine
        self.normalize = config.embd_normalize if normalize is None else normalize
        if isinstance(self.normalize, bool) or not isinstance(self.normalize, int) or self.normalize < -1:
            raise ValueError(f"embd_normalize must be an integer >= -1, got {self.normalize!r}")
        ctx = engine.ctx
        # Whether a prompt may be decoded in slices (see the module): a causal model that keeps its
        # memory between decodes. Any other sees a prompt within one decode (llama-server's can_split).
        self.sliceable = ctx.has_memory and ctx.causal_attn
        self._bitmaps: list[Bitmap] = []
        self.prompts: list[list] = []  # each prompt's parts: int32 token arrays and media chunks
        try:
            for item in inputs:
                self.prompts.append(self._parts(item))
        except BaseException:
            self.close()
            raise

    @classmethod
    def rerank(cls, engine: Any, query: str, documents: Seq[str]) -> "EmbeddingJob":
        """The (query, document) pairs of a reranker (``rerank_tokens``), each refused before it is
        tokenized when its text alone cannot fit what one prompt may hold: the query is tokenized
        once, so the work is linear in the query and the documents."""
        if not engine.config.embeddings or engine.ctx.pooling != "rank":
            raise ValueError("reranking needs an engine loaded with embeddings=True and pooling 'rank' "
                             "(llama-server's --reranking) and a reranker model")
        model, limit = engine.model, _prompt_limit(engine.ctx)
        for text in (query, *documents):
            at_least = model.tokens_at_least(len(text.encode("utf-8", errors="surrogatepass")))
            if at_least > limit:
                raise _too_large(f"at least {at_least}", limit)
        pairs = RerankPairs(model, query)
        if pairs.query_rows > limit:  # (a WordPiece vocabulary gives no bound before tokenizing)
            raise _too_large(f"more than {pairs.query_rows}", limit)
        # pair by pair, each checked as it is made: the first that does not fit ends it
        return cls(engine, (EmbeddingInput((pairs.tokens(doc),)) for doc in documents), normalize=-1)

    def _parts(self, item: EmbeddingInput) -> list:
        e = self.engine
        text, images = item.text, list(item.images)
        if not isinstance(text, (str, tuple)):
            raise TypeError(f"an embedding's text is a string or a tuple of strings and token arrays, "
                            f"got {type(text).__name__}")
        if images and e.projector is None:
            raise ImageError("images were given but the engine has no projector: load it with mmproj=... (--mmproj)")
        if images and not isinstance(text, str):
            raise ValueError("a prompt of token ids takes no images (give text with a media marker for each)")
        if images and not self.sliceable:
            raise ValueError("this model sees a prompt within one decode, and a picture is a decode of its own: "
                             "it embeds text only")
        if images and MEDIA_MARKER not in text:  # images without markers go first, as in a generation
            text = MEDIA_MARKER * len(images) + "\n" + text
        if not images and isinstance(text, str):
            text = (text,)  # text alone is text, a media marker in it too (as llama-server tokenizes it)
        bitmaps = []
        for image in images:
            bitmaps.append(Bitmap.load(image))
            self._bitmaps.append(bitmaps[-1])  # freed by close(), whatever fails next
        ctx = e.ctx
        try:
            parts = e.prompts.tokenize(text, bitmaps, to_generate=False)
        except ContextOverflowError:
            if self.sliceable or ctx.n_ctx_seq <= ctx.n_ubatch:
                raise  # the context is what it does not fit
            raise _too_large(f"more than {ctx.n_ctx_seq}", ctx.n_ubatch) from None
        except ValueError as err:
            if str(err) == EMPTY_PROMPT:
                raise ValueError("Input content cannot be empty") from None
            raise
        n_rows = rows_of(parts)
        if not self.sliceable and n_rows > ctx.n_ubatch:
            raise _too_large(str(n_rows), ctx.n_ubatch)
        return parts

    def prompt(self, i: int):
        """What embeds prompt ``i`` on a slot: a function of the slot's ``Sequence`` (run it with
        ``Engine.run_on_slot``; one prompt a time, so that other slots' generations go on between)."""
        return lambda seq: self._embed(seq, self.prompts[i])

    def _embed(self, seq: Sequence, parts: list) -> Embedding:
        e, ctx = self.engine, seq.ctx
        pooling = ctx.pooling
        n_ubatch = ctx.n_ubatch
        seq.reset()  # the slot's cached prompt goes: this prompt starts at position 0
        e.lora.apply(ctx, e.lora.scales_for(None))  # the global LoRA scales, not the last generation's
        # A sequence of its own over the same seq_id, without the drafter: the drafter sees nothing of it.
        own = Sequence(ctx, None, seq.seq_id, n_seq=ctx.n_seq_max)
        stats = GenerationStats()
        slices: list[tuple[int, np.ndarray]] = []  # (rows, pooled vector or the rows' vectors) per decode

        def read(n: int) -> None:
            slices.append((n, ctx.output_embeddings(n) if pooling == "none" else ctx.embeddings_of_sequence(seq.seq_id)))

        ctx.set_embeddings(True)
        try:
            for part in parts:
                if isinstance(part, np.ndarray):
                    for s in range(0, len(part), n_ubatch):
                        chunk = part[s:s + n_ubatch]
                        own.decode_text(chunk, True, stats)
                        read(len(chunk))
                else:
                    done = 0
                    for rows in own.decode_media(e.projector, part, stats, n_batch=n_ubatch, outputs=True):
                        read(rows - done)
                        done = rows
        finally:
            ctx.set_embeddings(False)
            own.close()
            seq.reset()  # its memory held this prompt's rows; the slot starts empty
        return Embedding(self._pool(pooling, slices), rows_of(parts), pooling, len(slices))

    def _pool(self, pooling: str, slices: list[tuple[int, np.ndarray]]) -> np.ndarray:
        if pooling == "none":  # a vector per row, not normalised (as llama-server)
            return np.concatenate([v for _, v in slices])
        if pooling == "mean":
            total = sum(n for n, _ in slices)
            vector = sum(v.astype(np.float64) * n for n, v in slices) / total
        elif pooling == "cls":
            vector = slices[0][1]
        else:  # "last", and "rank" (a causal reranker reads its last row; an encoder's prompt is one slice)
            vector = slices[-1][1]
        if pooling == "rank":  # scores, as the classifier gives them
            return np.asarray(vector, dtype=np.float32)[None, :]
        return normalize(vector, self.normalize)[None, :]

    def close(self) -> None:
        for b in self._bitmaps:
            b.close()
        self._bitmaps = []

    def __enter__(self) -> "EmbeddingJob":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _prompt_limit(ctx: Any) -> int:
    """The most rows one embedding prompt may take: an encoder's ubatch, else a slot's context."""
    return ctx.n_ctx_seq if ctx.has_memory and ctx.causal_attn else min(ctx.n_ubatch, ctx.n_ctx_seq)


def _too_large(n_tokens: str, n_ubatch: int) -> ValueError:
    # llama-server's words (its clients look for "too large"): an encoder sees a prompt within one ubatch only
    return ValueError(f"input ({n_tokens} tokens) is too large to process. increase the physical batch size "
                      f"(current batch size: {n_ubatch})")
