"""One request in progress, and the speculative step that advances many of them at once.

A ``Generation`` runs on one ``Sequence``: it prefills the prompt slice by slice
(``prefill``), samples the first token (``start``), and then takes part in steps. A step
(``speculative_step``) is the algorithm, for one sequence or for every active slot:

1. the drafter proposes a block for every generation that drafts (one draft call);
2. the target decodes every generation's ``[id_last, d1..dk]`` in one batch, each at its
   own sequence's ``pos_next``;
3. the drafter sees those rows (DFlash injects their features); where no generation drafted,
   each sequence holds them for its drafter's next use instead (``Sequence.hold_for_drafter``);
4. each verifier accepts the longest prefix its sampler agrees with, plus the target's
   own next token, and the sequence commits what was kept (sequence.py).

The slot loop (serving/slot_loop.py) drives them, one slot or many, each step over every
decoding slot.
"""

from __future__ import annotations

import codecs
import collections
import copy
import dataclasses
import time
from concurrent.futures import Future
from typing import Callable, Iterator

import numpy as np

from pyllama_spec.bindings.grammar import GrammarError
from pyllama_spec.drafters import Drafter, DraftRequest, Proposal, TargetDecode
from pyllama_spec.speculative.draft_length import StepCost, plan_lengths
from pyllama_spec.speculative.line_rules import LineRules
from pyllama_spec.speculative.logprobs import TokenLogprob, TokenProb, token_logprobs, token_post_sampling_probs
from pyllama_spec.speculative.sequence import Sequence, rows_of
from pyllama_spec.speculative.stats import GenerationStats, Stopwatch
from pyllama_spec.speculative.tree import TreeSeqs, build_tree

#: The most rows a sequence holds for its drafter (steps that drafted nothing: ``Sequence.hold_for_drafter``)
#: before they are shown in one batch: it bounds the copies a slot keeps (64 x the recorded layers x n_embd
#: floats: 5 MiB for five layers of 4096), and one drafter decode of 64 rows costs far less than 64 of one.
HELD_ROWS_MAX = 64

ProgressCallback = Callable[[str, int, int], None]


@dataclasses.dataclass(frozen=True)
class Ending:
    """How a generation ended, on its last piece: what llama-server's final response reports."""

    stop_type: str  # "eos", "word" (a stop string) or "limit" (max_tokens, the context, a line rule)
    stopping_word: str = ""  # the stop string that ended it
    truncated: bool = False  # it ended because the sequence's context was full
    #: Characters at the end of the streamed text that the whole answer drops (llama-server's
    #: n_indent cuts a line short after streaming it; line_rules.py).
    retract: int = 0
    cache_rows: int = 0  # cache rows of the prompt and the output but its last token (llama-server's tokens_cached)
    #: The prompt's text token arrays (media chunks left out), for llama-server's ``prompt`` field.
    prompt: tuple = ()


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece of streamed output: the text and tokens accepted in one step.

    The last piece of a stream has ``finish_reason``, ``stats`` and ``ending`` set.
    """

    text: str
    tokens: tuple[int, ...]
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    #: The text released at each of ``tokens`` (joined, they are ``text``). A token's text can show
    #: at a later token: a partial UTF-8 character or a possible stop string is held back until then.
    token_texts: tuple[str, ...] = ()
    #: The first ``from_draft`` of ``tokens`` are draft tokens the target accepted; the rest are the
    #: target's own (a step always ends with one).
    from_draft: int = 0
    #: Tokens the drafter proposed in the step that produced this piece (0 for the first token).
    drafted: int = 0
    #: With ``logprobs`` asked: one entry per token of ``tokens`` (speculative/logprobs.py): a
    #: TokenLogprob, or with ``post_sampling_probs`` a TokenProb (the probabilities after the chain).
    logprobs: tuple[TokenLogprob | TokenProb, ...] = ()
    ending: Ending | None = None
    #: On the pieces before the last: a copy of the stats at this step (the generation goes on).
    so_far: GenerationStats | None = None


@dataclasses.dataclass
class Result:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (end of generation or a stop string) or "length"
    stats: GenerationStats

    @classmethod
    def from_pieces(cls, pieces) -> "Result":
        """A whole generation from its streamed pieces (the last carries the stats)."""
        text, tokens, last = [], [], None
        for piece in pieces:
            text.append(piece.text)
            tokens.extend(piece.tokens)
            last = piece
        assert last is not None and last.stats is not None
        joined = "".join(text)
        if last.ending is not None and last.ending.retract:
            joined = joined[:len(joined) - last.ending.retract]
        return cls(joined, tokens, last.finish_reason or "stop", last.stats)


class Generation:
    """One request on one sequence: its prompt parts, sampling, stop rules and stats."""

    def __init__(self, seq: Sequence | None, model, parts: list, verifier, stats: GenerationStats, *,
                 max_tokens: int, stop: list[str], draft_length, draft_min: int, cache_prompt: bool = True,
                 progress: ProgressCallback | None = None, draft_positions: str = "target",
                 draft_tree: int = 0, logprobs: int | None = None, n_indent: int = 0,
                 t_max_predict_ms: float = 0, special_tokens: frozenset[int] = frozenset(),
                 post_sampling=None) -> None:
        self.seq = seq  # None until a scheduler gives it a slot
        self.draft_tree = draft_tree  # > 0: verify a tree of up to this many drafted tokens (tree.py)
        self.logprobs = logprobs  # None: none; N: each token's log-probability and the N most likely
        # the sampler's settings (SamplingParams) when the probabilities asked are those after its chain
        self.post_sampling = post_sampling
        # what the chain's penalties have seen: the tokens the verifier sampled or accepted so far
        penalized = post_sampling is not None and logprobs is not None and post_sampling.penalized
        last_n = post_sampling.penalty_last_n if penalized else 0
        self._history = collections.deque(maxlen=last_n if last_n > 0 else None) if penalized else None
        self.draft_positions = draft_positions
        self.model = model
        self.parts = parts
        self.verifier = verifier
        self.stats = stats
        self.max_tokens = max_tokens
        self.draft_length = draft_length
        self.draft_min = draft_min
        self.cache_prompt = cache_prompt
        self.progress = progress
        self.out = TextAssembler(model, stop, special_tokens)
        self.lines = LineRules(n_indent, t_max_predict_ms)  # llama-server's n_indent / t_max_predict_ms
        self.generated = 0
        self.id_last: int | None = None
        self.finished = False
        self.prefilled = False
        self._t0 = time.perf_counter()
        self._t1 = self._t0  # when decoding started
        self._prefill_split = (0.0, 0.0)  # target / draft seconds spent in prefill
        # Cache cells the next step may take, where slots share one pool (set by the slot loop before
        # each step; None: only this sequence's own n_ctx bounds it)
        self.cells_for_step: int | None = None

    # ------------------------------------------------------------------ prefill
    def prefill(self, n_batch: int, projector=None, encode_async=None) -> Iterator[Future | None]:
        """Decode what the cache does not hold yet, yielding after every decoded slice (or, with
        ``encode_async``, the Future of a media encode still running: see prefill_parts); after
        the last one ``prefilled`` is True (and the target's last decode holds the prompt's logits)."""
        seq, stats = self.seq, self.stats
        seq.set_draft_positions(self.draft_positions)  # the draft's cache is laid out by the mode
        if self.cache_prompt:
            todo = seq.keep_prefix(self.parts)
        else:
            seq.reset()
            todo = list(self.parts)
        stats.prompt_reused = seq.positions.n_rows
        if self.progress:  # the rows the cache already holds, of the whole prompt's
            self.progress("cache", stats.prompt_reused,
                          stats.prompt_reused + rows_of(todo))
        for rows_left in prefill_parts(seq, todo, stats, n_batch, projector, self.progress, encode_async):
            if isinstance(rows_left, Future):
                yield rows_left
                continue
            if rows_left == 0:
                stats.prompt_tokens, stats.prompt_positions = seq.positions.n_rows, seq.positions.pos_next
                self.prefilled = True  # the last decode holds the prompt's logits: start() must come next
            yield

    # ------------------------------------------------------------------ decoding
    def start(self) -> Piece | None:
        """After the prefill: sample the first token. Returns its piece (the last one if it ends there)."""
        stats = self.stats
        if self.max_tokens == 0:
            stats.prefill_seconds = time.perf_counter() - self._t0
            self.finished = True
            return Piece("", (), "length", stats, ending=self._ending("limit"))
        with Stopwatch(stats, "target_seconds"):
            id_last = self.verifier.first(self.seq.ctx)
        begin = getattr(self.seq.drafter, "begin", None)  # optional in the protocol (drafters/__init__.py)
        if begin is not None:
            begin(self.seq.seq_id)  # the prompt is in: the n-gram maps index it
        self._t1 = time.perf_counter()
        stats.prefill_seconds = self._t1 - self._t0
        self._prefill_split = (stats.target_seconds, stats.draft_seconds)
        return self._after_step([id_last], 0, rows=[-1])

    def _room(self) -> int:
        """Cache rows left for drafts after the next token's."""
        room = self.seq.n_ctx - self.seq.positions.n_rows - 1
        return room if self.cells_for_step is None else min(room, self.cells_for_step - 1)

    def draft_limit(self, n_batch_share: int) -> int:
        """The most this generation may draft in the next step: its tokens left, its cache rows
        left, its share of the target batch (0 without a drafter)."""
        if self.seq.drafter is None:
            return 0
        budget = self.max_tokens - self.generated
        return max(0, min(budget - 1, self._room(), n_batch_share - 1))

    def tree_limit(self, n_batch: int) -> int:
        """The most tree nodes (drafted tokens) the next step may verify: the tree budget, the free
        cache rows (every node takes a cell during the decode) and the target batch."""
        return max(0, min(self.draft_tree, self._room(), n_batch - 1))

    def draft_request(self, n_max: int) -> DraftRequest | None:
        """What this generation asks the drafter for in the next step (None: no draft; ``n_max``
        within ``draft_limit``, which is 0 without a drafter)."""
        if n_max <= 0:
            return None
        p = self.seq.positions
        return DraftRequest(self.seq.seq_id, self.id_last, p.pos_next, p.draft_pos_next, n_max, self.draft_min)

    def _after_step(self, new_tokens: list[int], drafted: int, rows: list[int]) -> Piece | None:
        """Show what a step produced and decide whether to go on; the piece to stream, if any.
        ``rows``: the target's output row that verified each of ``new_tokens``."""
        stats = self.stats
        emit, finish = self._emittable(new_tokens)
        # The context is full at the token after which one cache row is left (llama-server without
        # --context-shift ends there, ``truncated``): the rows before this step's first token, and
        # how many of its tokens fit until then.
        fit = self.seq.n_ctx - (self.seq.positions.n_rows - len(new_tokens) + 1)
        truncated = len(emit) >= fit
        if truncated:
            emit, finish = emit[:max(fit, 0)], "length"
        if self.logprobs is not None and emit and self.post_sampling is not None:
            origin_logprobs = tuple(token_post_sampling_probs(self.seq.ctx, rows, emit, self.logprobs,
                                                              self.post_sampling, self._history or ()))
        elif self.logprobs is not None and emit:
            origin_logprobs = tuple(token_logprobs(self.seq.ctx, rows, emit, self.logprobs))
        else:
            origin_logprobs = ()
        if self._history is not None:
            self._history.extend(new_tokens)  # every token the sampler accepted, as its penalties see them
        texts, hit_stop = self.out.push_each(emit)
        if hit_stop and self.out.stopped_at < len(emit) - 1:
            truncated = False  # the stop string came first
            # the tokens after the one that completed it were never generated, as llama-server counts
            k = self.out.stopped_at + 1
            emit, texts, origin_logprobs = emit[:k], texts[:k], origin_logprobs[:k]
        stop_type = "limit" if truncated else "word" if hit_stop else "eos" if finish == "stop" else "limit"
        if hit_stop and not truncated:
            finish = "stop"
        retract = None
        if self.lines.active:
            t_gen_ms = (time.perf_counter() - self._t1) * 1000
            for k, text in enumerate(texts):
                if hit_stop and k >= self.out.stopped_at:
                    break  # the stop string came first
                retract = self.lines.push(text, t_gen_ms)
                if retract is not None:  # a line rule ends the generation at token k
                    emit, texts, origin_logprobs = emit[:k + 1], texts[:k + 1], origin_logprobs[:k + 1]
                    finish, stop_type, hit_stop = "length", "limit", False
                    break
        self.generated += len(emit)
        stats.generated_tokens = self.generated  # kept current: an interrupted stream's stats stay true
        stats.decode_seconds = time.perf_counter() - self._t1
        if retract is not None:
            truncated = False  # a line rule ended it first
        # All but the last of a step's tokens are accepted drafts (the first token has no draft).
        origin = dict(token_texts=texts, from_draft=min(len(emit), len(new_tokens) - 1), drafted=drafted,
                      logprobs=origin_logprobs)
        self.id_last = new_tokens[-1]
        if finish is None:
            return Piece("".join(texts), tuple(emit), **origin, so_far=self._so_far()) if emit else None
        self.finished = True
        stats.decode_target_seconds = stats.target_seconds - self._prefill_split[0]
        stats.decode_draft_seconds = stats.draft_seconds - self._prefill_split[1]
        # what the sampler held back (a partial character, a possible stop string's start) ends the
        # text, unless a line rule cut the line it is on
        rest = self.out.flush() if not retract else ""
        if rest:
            texts = (*texts[:-1], texts[-1] + rest) if texts else (rest,)
            origin["token_texts"] = texts if emit else ()
        ending = self._ending(stop_type, truncated=truncated, retract=retract or 0)
        return Piece("".join(texts), tuple(emit), finish, stats, **origin, ending=ending)

    def _ending(self, stop_type: str, *, truncated: bool = False, retract: int = 0) -> Ending:
        # the rows of what the client saw: the prompt and every emitted token but the last (never
        # decoded); a step cut short may have left rows of tokens it did not emit after them
        rows = min(self.seq.positions.n_rows, self.stats.prompt_tokens + max(self.generated - 1, 0))
        return Ending(stop_type, self.out.stopping_word, truncated, retract, rows,
                      tuple(p for p in self.parts if isinstance(p, np.ndarray)))

    def _so_far(self) -> GenerationStats:
        """A copy of the stats now (its lists too), for a piece that is not the last."""
        s = copy.copy(self.stats)  # (dataclasses.replace runs __init__ and its checks: dearer, per step)
        s.per_position_drafted, s.per_position_accepted = list(s.per_position_drafted), list(s.per_position_accepted)
        return s

    def _emittable(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """The tokens to show from one step, cut at end-of-generation or the token limit."""
        emit = []
        for tok in tokens:
            if self.model.is_eog(tok):
                return emit, "stop"
            emit.append(tok)
            if self.generated + len(emit) >= self.max_tokens:
                return emit, "length"
        return emit, None


def prefill_parts(seq: Sequence, parts: list, stats: GenerationStats, n_batch: int, projector=None,
                  progress: ProgressCallback | None = None, encode_async=None) -> Iterator[int | Future]:
    """Decode prompt parts after what ``seq`` holds, in slices of n_batch rows, yielding the rows
    left after each:
    text at consecutive positions from pos_next (logits for the last row only), media encoded and
    then decoded with its own positions. ``progress("encode" | "prefill", rows done, rows total)``.

    With ``encode_async(chunk) -> Future`` (a scheduler's encoder thread), a media chunk's encode
    runs there: until it is done this yields the Future (nothing decoded), so other sequences
    keep decoding meanwhile."""
    total = rows_of(parts)
    done = 0
    for i, part in enumerate(parts):
        if isinstance(part, np.ndarray):
            last_part = i == len(parts) - 1
            for s in range(0, len(part), n_batch):
                tokens = part[s:s + n_batch]
                outputs = np.zeros(len(tokens), dtype=np.int8)
                if last_part and s + n_batch >= len(part):
                    outputs[-1] = 1
                seq.decode_text(tokens, outputs, stats)
                done += len(tokens)
                if progress:
                    progress("prefill", done, total)
                yield total - done
        else:
            if progress:
                progress("encode", done, total)
            embd = None
            if encode_async is not None:
                encoding = encode_async(part)
                while not encoding.done():
                    yield encoding
                embd, seconds = encoding.result()  # raises what the encode raised
                stats.target_seconds += seconds
            for rows in seq.decode_media(projector, part, stats, n_batch=n_batch, embd=embd):
                if progress:
                    progress("prefill", done + rows, total)
                if rows < part.n_tokens:
                    yield total - done - rows
            done += part.n_tokens
            yield total - done  # after the chunk's positions moved on


def speculative_step(ctx, drafter: Drafter | None, gens: list[Generation],
                     step_cost: StepCost | None = None) -> list[Piece | None | Exception]:
    """One draft / verify / accept step for every generation in ``gens`` (one target decode for all).

    ``step_cost`` (the engine's, shared by its adaptive rules) learns from every step that
    drafted: its rows and its time, whatever rule chose the lengths, so adaptive requests start
    with what earlier ones measured.

    Returns each generation's piece (None where a step streams nothing), or the GrammarError that
    ended that generation alone: what its own sampler raised while accepting (a grammar that allows
    no token, or whose stacks pass the bound), the others in the step going on. Raises
    what the shared calls raise (the draft, the decode). The caller resets the sequences of a step,
    or of a generation, that did not finish.
    """
    start = time.perf_counter()
    share = ctx.n_batch // len(gens)  # every block must fit in one target batch (n_parallel <= n_batch)
    rules = [g.draft_length for g in gens]
    lengths = plan_lengths(rules, [g.draft_limit(share) for g in gens])  # adaptive slots planned together
    requests = [g.draft_request(n) for g, n in zip(gens, lengths)]
    asked = [r for r in requests if r is not None]
    made: list[Proposal] = []
    for g in gens:  # rows held by steps that drafted nothing: shown before a draft, or once a batch is held
        if g.seq.holds_rows and (asked or g.seq.held_rows >= HELD_ROWS_MAX):
            t = time.perf_counter()
            rows = g.seq.show_drafter(g.stats)
            caught_up = time.perf_counter() - t
            start += caught_up  # the earlier steps' cost, not this one's: the plain steps' share it is
            if step_cost is not None:
                step_cost.update_catch_up(rows, caught_up)
    if asked:
        t = time.perf_counter()
        made = drafter.draft(asked)
        for g, r in zip(gens, requests):  # a shared call costs every generation that waited for it
            if r is not None:
                g.stats.draft_seconds += time.perf_counter() - t
    if gens[0].draft_tree and made and made[0].logits is not None and len(made[0]):
        return [_tree_step(ctx, drafter, gens[0], made[0], start, step_cost)]  # trees: one generation
    proposals = iter(made)
    drafts, verify_rows, offsets = [], [], []
    row = 0
    for g, r in zip(gens, requests):
        proposal = next(proposals) if r is not None else Proposal([])
        draft = g.verifier.proposal_tokens(proposal)  # rejection sampling draws x ~ q here
        tokens = np.array([g.id_last, *draft], dtype=np.int32)
        drafts.append((proposal, draft))
        verify_rows.append(g.seq.text_rows(tokens, row_offset=row))
        offsets.append(row)
        row += len(tokens)

    t = time.perf_counter()
    batch = ctx.shared_token_batch()
    batch.clear()
    for rows in verify_rows:
        batch.add_tokens(rows.tokens, rows.section0, outputs=True, seq_id=rows.seq_id)
    ctx.decode(batch)  # verify: logits on every row
    if drafter is not None and not asked:  # no draft in this step: its rows wait for the next one that drafts
        t_draft = time.perf_counter()
        decode = TargetDecode(verify_rows, ctx)
        for g, rows in zip(gens, verify_rows):
            g.seq.hold_for_drafter(decode, rows)
        for g in gens:
            g.stats.draft_seconds += time.perf_counter() - t_draft
        t_target = t_draft - t
    elif drafter is not None:
        t_draft = time.perf_counter()
        drafter.process(TargetDecode(verify_rows, ctx))
        for g in gens:
            g.stats.draft_seconds += time.perf_counter() - t_draft
        t_target = t_draft - t
    else:
        t_target = time.perf_counter() - t

    pieces: list[Piece | None | Exception] = []
    for g, (proposal, draft), rows, at in zip(gens, drafts, verify_rows, offsets):
        t = time.perf_counter()
        try:
            accepted = g.verifier.accept(ctx, draft, proposal, row=at)
        except GrammarError as e:  # this generation's own sampler (its grammar, its bias): the others go on
            # (without its traceback, whose frames would keep this step's generations and batch alive)
            pieces.append(e.with_traceback(None))
            continue
        g.stats.target_seconds += t_target + time.perf_counter() - t
        n_kept = len(accepted)  # id_last + the accepted drafts
        g.seq.commit(rows.tokens, n_kept)
        if draft and hasattr(drafter, "accept"):
            drafter.accept(g.seq.seq_id, n_kept - 1)
        g.stats.record_step(len(draft), n_kept - 1)
        g.draft_length.update(len(draft), n_kept - 1, time.perf_counter() - start)
        g.stats.target_steps += 1
        pieces.append(g._after_step(accepted, len(draft), rows=list(range(at, at + len(accepted)))))
    if step_cost is not None and asked:  # a step without a draft call costs less than the fit's base
        step_cost.update(row, time.perf_counter() - start)  # the whole step: all its rows, all its time
    elif step_cost is not None and len(gens) == 1 and gens[0].seq.drafter is not None:
        step_cost.update_plain(time.perf_counter() - start)  # drafting off: what a plain step costs
    return pieces


def _tree_step(ctx, drafter: Drafter, g: Generation, proposal: Proposal, start: float,
               step_cost: StepCost | None) -> Piece | None:
    """The verify half of a step with a draft tree (tree.py), for a generation alone on its context.

    The tree's nodes are decoded in one batch with tree attention: every leaf has a sequence
    id of its own (the prompt shared into it), every node carries the leaves below it. The
    target's sampler walks down the tree; the accepted path's cells are then given to the
    sequence and every leaf sequence is dropped, which frees the other nodes' cells (also when
    the decode fails: the sequence's own cells are never touched before the walk is done).
    """
    seq, stats = g.seq, g.stats
    p, mem, main = seq.positions, ctx.memory, seq.seq_id
    tree = build_tree(g.id_last, proposal.logits, g.tree_limit(ctx.n_batch))
    seqs = TreeSeqs.assign(tree, first_seq=main + 1)
    t = time.perf_counter()
    batch = ctx.shared_token_batch()
    batch.clear()
    try:
        for s in seqs.leaf_seqs:
            mem.copy(main, s)
        batch.add_tree_tokens(tree.tokens, p.pos_next + tree.depth, seqs.node_seqs)
        ctx.decode(batch)  # every node's logits
        nodes, last = g.verifier.walk_tree(ctx, tree)
        mem.copy(seqs.seq_through(nodes[-1] if nodes else 0), main, p.pos_next, p.pos_next + len(nodes) + 1)
    finally:
        for s in seqs.leaf_seqs:
            mem.remove(s, -1, -1)
    path = np.asarray([0, *nodes])
    tokens = tree.tokens[path]
    stats.target_seconds += time.perf_counter() - t
    t = time.perf_counter()
    # the accepted path's features only
    drafter.process(TargetDecode([dataclasses.replace(seq.text_rows(tokens), row_index=path)], ctx))
    stats.draft_seconds += time.perf_counter() - t
    seq.commit(tokens, len(tokens))  # the memory already holds exactly the path
    if hasattr(drafter, "accept"):
        drafter.accept(main, len(nodes))
    stats.record_step(tree.n_drafted, len(nodes), tree.max_depth)
    stats.target_steps += 1
    g.draft_length.update(tree.max_depth, len(nodes), time.perf_counter() - start)
    if step_cost is not None:
        step_cost.update(len(tree), time.perf_counter() - start)
    # each accepted token was sampled at its parent's row; the last at the path's end
    return g._after_step([*tokens[1:].tolist(), last], tree.n_drafted, rows=path.tolist())


class _StopMatcher:
    """Where one stop string stands in the text streamed so far (Knuth-Morris-Pratt, fed a chunk at a time).

    ``k`` is the length of the longest prefix of the stop string that is a suffix of the text so far.
    The failure function is built lazily, only as far as ``k`` has reached: the work per request is
    linear in the text generated and the memory is bounded by it, however long the stop string is.
    """

    __slots__ = ("s", "k", "fail")

    def __init__(self, s: str) -> None:
        self.s = s
        self.k = 0
        self.fail = [0]  # fail[i]: the longest proper prefix of s[:i+1] that is also its suffix

    def _extend(self, m: int) -> None:
        """Fill in ``fail[:m]`` (fail[i] needs only fail[:i] and s[:i+1]); amortized O(1) an entry."""
        s, fail = self.s, self.fail
        j = fail[-1]
        for i in range(len(fail), m):
            c = s[i]
            while j > 0 and s[j] != c:
                j = fail[j - 1]
            if s[j] == c:
                j += 1
            fail.append(j)

    def feed(self, text: str, end: int) -> int:
        """Advance over ``text[:end]``; the index just past the character that completes the stop
        string (where it stops reading), or -1."""
        s, k, fail = self.s, self.k, self.fail
        n, first, i = len(s), s[0], 0
        while i < end:
            if k == 0:
                i = text.find(first, i, end)  # skip, at C speed, what cannot start the stop string
                if i < 0:
                    break
                k, i = 1, i + 1
            else:
                c = text[i]
                while k > 0 and s[k] != c:
                    k = fail[k - 1]
                if s[k] == c:
                    k += 1
                i += 1
            if k == n:
                self.k = k
                return i
            if k > len(fail):
                self._extend(k)  # a mismatch at state k falls back to fail[k - 1]
        self.k = k
        return -1


class TextAssembler:
    """Token bytes -> text, holding back partial UTF-8 and any tail that may start a stop string.

    Text is released as soon as it cannot be the start of any stop string. When several stop strings
    could match, the first to complete (character by character) wins, and of those completing at the
    same character the one that starts earliest; the output ends right before its first character.
    """

    def __init__(self, model, stop: list[str], special_tokens: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.special = special_tokens  # written out as their text (a chat's preserved tokens), as llama-server
        self.stop = [s for s in stop if s]
        self._matchers = [_StopMatcher(s) for s in self.stop]
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held: collections.deque[str] = collections.deque()  # chunks; the first from _held_off
        self._held_off = 0
        self._held_len = 0
        self.stopped = False
        self.stopping_word = ""  # the stop string that matched
        self.stopped_at = 0  # push_each: the token at which it matched

    @property
    def held(self) -> str:
        """The text held back (a possible start of a stop string)."""
        return "".join(self._held)[self._held_off:]

    def push_each(self, tokens: list[int]) -> tuple[tuple[str, ...], bool]:
        """``push`` token by token: the text released at each token, and whether a stop string was hit
        (``stopped_at``: at which of these tokens)."""
        texts = []
        for i, tok in enumerate(tokens):
            was = self.stopped
            texts.append(self.push([tok])[0])  # after a stop string, each releases ""
            if self.stopped and not was:
                self.stopped_at = i
        return tuple(texts), self.stopped

    def push(self, tokens: list[int]) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        new = "".join(self.decoder.decode(self.model.token_to_bytes(t, special=t in self.special)) for t in tokens)
        if not new:
            return "", False
        if not self._matchers:
            return new, False
        end, longest, word = len(new), 0, ""  # the earliest completion so far: its end in ``new``, its length
        for m in self._matchers:
            at = m.feed(new, end)
            if at >= 0 and (at < end or len(m.s) > longest):
                end, longest, word = at, len(m.s), m.s
        self._held.append(new)
        self._held_len += len(new)
        if longest:  # a stop string ends at new[end - 1]: release what comes before its first character
            self.stopped = True
            self.stopping_word = word
            out = self._release(self._held_len - (len(new) - end) - longest)
            self._held.clear()
            self._held_off = self._held_len = 0
            return out, True
        keep = max(m.k for m in self._matchers)  # those chars are s[:keep] of a stop string s
        return self._release(self._held_len - keep), False

    def _release(self, n: int) -> str:
        """Take the first ``n`` characters held (in time linear in ``n`` plus the chunks taken)."""
        if n <= 0:
            return ""
        out, held = [], self._held
        self._held_len -= n
        while n:
            chunk, off = held[0], self._held_off
            take = min(n, len(chunk) - off)
            out.append(chunk[off:off + take] if off or take < len(chunk) else chunk)
            n -= take
            if off + take == len(chunk):
                held.popleft()
                self._held_off = 0
            else:
                self._held_off = off + take
        return "".join(out)

    def flush(self) -> str:
        if self.stopped:
            return ""
        rest = self._release(self._held_len) + self.decoder.decode(b"", final=True)
        return rest
