"""Sampling settings (llama-server's), and the sampler chain in numpy for rejection sampling.

``SamplingParams`` holds every setting llama-server's samplers take; ``bindings.sampler.Sampler``
builds llama.cpp's native chain from it (logit bias -> grammar -> the ``samplers`` in order ->
the final pick). Rejection sampling needs the target's and the draft's distributions *after*
the chain, for whole verify blocks at once, so part of it is written here over numpy arrays
(rows at a time, no loop over the vocabulary): logit bias, the repeat/frequency/presence
penalties, top-k, top-p, min-p and temperature, in llama.cpp's order. The other samplers
(a grammar, DRY, XTC, typical-p, top-n-sigma, mirostat, dynamic temperature) are native only:
``rejection_unsupported`` names those a request turns on, and such a request verifies by "match".

Distributions are kept sparse when top-k bounds them: ``Dist(ids, probs)`` per row.
Pure Python + numpy: nothing native here.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

#: llama-server's default sampler order (``--samplers``), by its canonical names.
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
#: Every name llama-server takes for each sampler (common_sampler_types_from_names: canonical,
#: kebab-case, no dash, and a few others), lower case, and its one-letter code (--sampler-seq).
SAMPLER_NAMES = {
    **{n: n for n in ("dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc", "penalties")},
    **{n.replace("_", "-"): n for n in ("top_k", "top_p", "top_n_sigma", "typ_p", "min_p")},
    **{n.replace("_", ""): n for n in ("top_k", "top_p", "top_n_sigma", "typ_p", "min_p")},
    "nucleus": "top_p", "temp": "temperature", "typ": "typ_p",
}
SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                 "t": "temperature", "x": "xtc", "e": "penalties"}
DRY_SEQUENCE_BREAKERS = ("\n", ":", "\"", "*")


def sampler_order(names) -> tuple[str, ...]:
    """Sampler names (a list, or llama-server's one-letter string such as "dkypmxt") as canonical
    names in order; ValueError for a name llama-server would not take."""
    if isinstance(names, str):
        bad = [c for c in names if c not in SAMPLER_CHARS]
        if bad:
            raise ValueError(f"unknown sampler letter(s) {''.join(bad)!r}; use {''.join(SAMPLER_CHARS)}")
        return tuple(SAMPLER_CHARS[c] for c in names)
    out = []
    for n in names:
        key = str(n).lower()
        if key not in SAMPLER_NAMES:
            raise ValueError(f"unknown sampler {n!r}; use {', '.join(DEFAULT_SAMPLERS)}")
        out.append(SAMPLER_NAMES[key])
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One generation's sampling settings, by llama-server's defaults (temperature aside: 0,
    greedy, is this library's default). ``logit_bias``: (token, bias) pairs, -inf forbids."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64  # llama-server's default; -1: the context size
    dry_sequence_breakers: tuple[str, ...] = DRY_SEQUENCE_BREAKERS
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    mirostat: int = 0  # 1 or 2: mirostat replaces the chain after temperature
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    min_keep: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    grammar: str | None = None  # GBNF; the output follows it
    # A chat's constraint, as llama-server's sampler takes it from the chat template (common/chat.h):
    # a lazy grammar applies from the first match of one of its triggers on ((type, value): 1 a word,
    # 2 a pattern, 3 a pattern matching the whole output; common_grammar_trigger_type); preserved
    # tokens are written out in the text (and a one-token trigger word must be one); a "tool_calls"
    # or "output_format" grammar (a chat's) starts with the generation prompt already seen.
    grammar_lazy: bool = False
    grammar_triggers: tuple[tuple[int, str], ...] = ()
    preserved_tokens: tuple[str, ...] = ()
    grammar_type: str = "user"  # "user", "output_format" or "tool_calls" (llama-server's common_grammar_type)
    generation_prompt: str = ""
    # The reasoning budget (llama-server's --reasoning-budget): at most this many tokens between the
    # start tag and one of the end tags, then the message and the first end tag are forced (-1: no
    # limit; tags from the chat template).
    reasoning_budget_tokens: int = -1
    reasoning_budget_start: str = ""
    reasoning_budget_end: tuple[str, ...] = ()
    reasoning_budget_message: str = ""

    @property
    def reasoning_budget_active(self) -> bool:
        """Whether the budget sampler runs (common_sampler_init's rule: tags, and a limit or a lazy
        grammar, which pauses while the model thinks)."""
        return bool(self.reasoning_budget_start and self.reasoning_budget_end) and \
            (self.grammar_lazy or self.reasoning_budget_tokens >= 0)

    @property
    def chat_constrained(self) -> bool:
        """Whether the chat constraint (grammar with triggers or a prefill, reasoning budget) is on."""
        return (self.grammar is not None and (self.grammar_lazy or self.grammar_type != "user")) or \
            self.reasoning_budget_active

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repeat_penalty != 1.0) and \
            self.penalty_last_n != 0

    def rejection_unsupported(self) -> list[str]:
        """The settings turned on here that the numpy chain does not apply (see the module's doc)."""
        on = {"grammar": self.grammar is not None, "reasoning_budget": self.reasoning_budget_active,
              "dry_multiplier": self.dry_multiplier > 0,
              "xtc_probability": self.xtc_probability > 0 and self.xtc_threshold <= 0.5,
              "typical_p": self.typical_p < 1.0, "top_n_sigma": self.top_n_sigma > 0,
              "mirostat": self.mirostat != 0, "dynatemp_range": self.dynatemp_range > 0,
              "min_keep": self.min_keep > 1,
              "samplers": tuple(n for n in self.samplers if n in _NUMPY_CHAIN) != tuple(
                  n for n in DEFAULT_SAMPLERS if n in _NUMPY_CHAIN and n in self.samplers)}
        return [name for name, active in on.items() if active]


#: The most alternatives ``logprobs`` lists at one position (OpenAI allows 20; llama-server's
#: n_probs has no limit of its own, a request's cost grows with it).
MAX_TOP_LOGPROBS = 100


def sampling_params(given: dict, *, n_ctx: int, n_vocab: int) -> SamplingParams:
    """``SamplingParams`` from keyword arguments, checked and normalised: a TypeError for a name
    that is not a setting, a ValueError for a value out of range; ``logit_bias`` as pairs (a dict
    {token: bias} or pairs; a bias of False, as llama-server takes it, forbids the token);
    ``samplers`` as canonical names; -1 last-n settings as the context size."""
    fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise TypeError(f"unknown sampling setting(s) {', '.join(unknown)}; the settings are {', '.join(fields)}")
    v = dict(given)
    for name in ("top_k", "penalty_last_n", "dry_allowed_length", "dry_penalty_last_n", "mirostat", "min_keep"):
        if name in v and (isinstance(v[name], bool) or not isinstance(v[name], (int, np.integer))):
            raise ValueError(f"{name} must be an integer, got {v[name]!r}")
    for name, f in fields.items():
        if name in v and f.type == "float" and (isinstance(v[name], bool) or not isinstance(v[name], (int, float, np.number))
                                                or not np.isfinite(v[name])):
            raise ValueError(f"{name} must be a finite number, got {v[name]!r}")
    if "mirostat" in v and v["mirostat"] not in (0, 1, 2):
        raise ValueError(f"mirostat must be 0, 1 or 2, got {v['mirostat']!r}")
    if v.get("repeat_penalty", 1.0) <= 0:
        raise ValueError(f"repeat_penalty must be > 0 (1.0: off), got {v['repeat_penalty']!r}")
    for name in ("penalty_last_n", "dry_penalty_last_n"):
        if name in v and v[name] < -1:
            raise ValueError(f"{name} must be >= -1 (-1: the context size), got {v[name]!r}")
    if v.get("penalty_last_n") == -1:
        v["penalty_last_n"] = n_ctx
    if v.get("dry_penalty_last_n", SamplingParams.dry_penalty_last_n) == -1:
        v["dry_penalty_last_n"] = n_ctx
    if "logit_bias" in v:
        v["logit_bias"] = _logit_bias(v["logit_bias"], n_vocab)
    if "samplers" in v:
        v["samplers"] = sampler_order(v["samplers"])
    if "dry_sequence_breakers" in v:
        b = v["dry_sequence_breakers"]
        if isinstance(b, str) or not all(isinstance(x, str) and x for x in b) or not len(b):
            raise ValueError("dry_sequence_breakers must be a non-empty list of non-empty strings")
        v["dry_sequence_breakers"] = tuple(b)
    _chat_constraint(v)
    if v.get("grammar") is not None and not isinstance(v["grammar"], str):
        raise ValueError(f"grammar must be a GBNF string, got {type(v['grammar']).__name__}")
    if v.get("grammar") == "":
        v["grammar"] = None  # llama-server: an empty grammar is no grammar
    if v.get("grammar") is not None:
        check_grammar_size(v["grammar"])
    return SamplingParams(**v)


GRAMMAR_TYPES = ("user", "output_format", "tool_calls")
GRAMMAR_TRIGGER_TYPES = {1: "word", 2: "pattern", 3: "pattern_full"}


def _chat_constraint(v: dict) -> None:
    """Check (and make tuples of) the chat constraint's settings in ``v``."""
    if "grammar_type" in v and v["grammar_type"] not in GRAMMAR_TYPES:
        raise ValueError(f"grammar_type must be one of {GRAMMAR_TYPES}, got {v['grammar_type']!r}")
    for name in ("grammar_lazy",):
        if name in v and not isinstance(v[name], bool):
            raise ValueError(f"{name} must be a boolean, got {v[name]!r}")
    for name in ("generation_prompt", "reasoning_budget_start", "reasoning_budget_message"):
        if name in v and not isinstance(v[name], str):
            raise ValueError(f"{name} must be a string, got {v[name]!r}")
    for name in ("preserved_tokens", "reasoning_budget_end"):
        if name in v:
            if isinstance(v[name], str) or not all(isinstance(x, str) for x in v[name]):
                raise ValueError(f"{name} must be a list of strings, got {v[name]!r}")
            v[name] = tuple(v[name])
    if "grammar_triggers" in v:
        triggers = []
        for t in v["grammar_triggers"]:
            if not (isinstance(t, (tuple, list)) and len(t) == 2 and t[0] in GRAMMAR_TRIGGER_TYPES
                    and isinstance(t[1], str)):
                raise ValueError(f"grammar_triggers must be (type, text) pairs with a type of "
                                 f"{GRAMMAR_TRIGGER_TYPES}, got {t!r}")
            triggers.append((int(t[0]), t[1]))
        v["grammar_triggers"] = tuple(triggers)
    n = v.get("reasoning_budget_tokens", -1)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < -1:
        raise ValueError(f"reasoning_budget_tokens must be an integer >= -1 (-1: no limit), got {n!r}")


#: The largest grammar taken, and how deeply its groups may nest: llama.cpp's parser and its
#: left-recursion check recurse once per level and per rule, on the generating thread's stack.
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_GRAMMAR_NESTING = 256
#: The most symbols a grammar may hold once llama.cpp's parser has written out its repetitions
#: ("x"{0,2000} is 2,000 optional rules, each holding "x"): about 0.15 s and 30 MB of parsing here
#: (bench/RESULTS.md, "A hostile client: grammars, slot files, other sites").
MAX_GRAMMAR_ELEMENTS = 2 ** 19
#: llama.cpp's MAX_REPETITION_THRESHOLD: a larger maximum is read as none ({m,}), a larger minimum refused.
_REPETITION_THRESHOLD = 2000
#: The bytes of the names llama.cpp's parser may make for the rules it adds (a std::string each, in a
#: map): about 32 MB, a few tenths of a second. Each name is its rule's name, "_" and a number,
#: counted with its map node (some 48 bytes more).
MAX_GRAMMAR_NAME_BYTES = 32 * 2**20
_GENERATED_NAME_BYTES = 56

# GBNF's tokens, as far as the parsed grammar's size goes: literals, character classes and comments
# (skipped whole; an unterminated one runs to the end, so that no match is retried from every
# position), "::=", groups, alternatives, repetition operators ("{" alone: its contents are read by
# hand, llama.cpp allowing spaces, newlines and comments inside) and names.
_COMMENT_END = re.compile(r"[\r\n]")
_GBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"?|\[(?:\\.|[^\]\\])*\]?|#[^\r\n]*|::=|[()|*+?{]|[A-Za-z0-9_.-]+')


def check_grammar_size(gbnf: str) -> None:
    """Refuse (ValueError, naming the limit) a grammar too large, nested too deep, or whose repetitions
    would make llama.cpp's parser write out too many symbols; in time linear in its length."""
    if len(gbnf) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the grammar is {len(gbnf)} characters; at most {MAX_GRAMMAR_CHARS} are taken")
    if not any(c in gbnf for c in "({*+?"):
        return  # no group and no repetition: its parsed size is about its length, and it adds no rule
    depth, elements, names = _parsed_size(gbnf)
    if depth > MAX_GRAMMAR_NESTING:
        raise ValueError(f"the grammar nests groups {depth} deep; at most {MAX_GRAMMAR_NESTING} levels are taken")
    if elements > MAX_GRAMMAR_ELEMENTS:
        raise ValueError(f"the grammar's repetitions make about {elements} symbols once written out (x{{m,n}} is "
                         f"n copies of x and n - m rules); at most {MAX_GRAMMAR_ELEMENTS} are taken: use * or + "
                         "for long runs")
    if names > MAX_GRAMMAR_NAME_BYTES:
        raise ValueError(f"the grammar's groups and repetitions make rules whose names (each its rule's name and a "
                         f"number) take about {names} bytes; at most {MAX_GRAMMAR_NAME_BYTES} are taken: use shorter "
                         "rule names")


def _parsed_size(gbnf: str) -> tuple[int, int, int]:
    """(deepest group nesting, symbols once llama.cpp's parser has written out every repetition, bytes
    of the names it makes for the rules it adds).

    As llama.cpp's parser does (llama-grammar.cpp, ``handle_repetitions``): a repetition copies what
    came since the element before it began, a literal (its characters), a class, a rule name or a group
    (one reference to the group's rule, whose contents are written once), and a repetition of that
    repetition copies all of it again; ``x{m,n}`` is n copies of x and n - m optional rules of three more
    symbols each; a maximum above 2,000 is read as none, and ``x{m,}`` is m + 1 copies and one rule;
    ``x*``, ``x+`` and ``x?`` are ``x{0,}``, ``x{1,}`` and ``x{0,1}``. Comments are spaces. Linear in
    the text's length. Each group and each optional rule of a repetition is a rule of its own, named
    after the rule it is in (``generate_symbol_id``: the name, "_" and a number), so a long rule name
    costs again with every one."""
    total, depth, deepest, last = 0, 0, 0, 0
    names, rule_name, previous = 0, 0, ""
    pos, n = 0, len(gbnf)
    while True:
        m = _GBNF_TOKEN.search(gbnf, pos)
        if m is None:
            break
        pos = m.end()
        tok = m.group(0)
        c = tok[0]
        if c == "#":
            continue  # a comment is a space: the element before it can still be repeated
        if tok == "::=":
            rule_name = len(previous)
        previous = tok
        if c == "|" or tok == "::=":
            last = 0
            continue
        if c == "(":
            names += rule_name + _GENERATED_NAME_BYTES
            depth += 1
            deepest = max(deepest, depth)
            last = 0
            continue
        if c in "*+?{":
            if c == "{":
                bounds, pos = _braces(gbnf, pos)
                if bounds is None:
                    continue  # not a repetition llama.cpp reads: it refuses the grammar
                low, high = bounds
                if high is not None and low <= _REPETITION_THRESHOLD and high < low:
                    # llama.cpp counts the n - m optional rules in an unsigned integer: n < m wraps
                    # around, and its parser writes rules until the memory is gone
                    raise ValueError(f"the grammar repeats an element {{{low},{high}}} times: the maximum is below "
                                     "the minimum")
            else:
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            if high is not None and high > _REPETITION_THRESHOLD:
                high = None  # llama.cpp: no maximum
            copies, rules = (low + 1, 1) if high is None else (max(high, low), high - low if high > low else 0)
            total += last * (copies - 1) + 3 * rules  # the element itself is counted already
            names += rules * (rule_name + _GENERATED_NAME_BYTES)
            # what a repetition of this repetition copies: the element's m copies and the reference
            last = last * low + (1 if rules else 0)
            continue
        if c == ")":
            depth = max(depth - 1, 0)
            size = 1  # the reference to the group's rule
        elif c == '"' or c == "[":
            size = max(1, len(tok) - 2)
        else:
            size = 1
        total += size
        last = size
    return deepest, total, names


def _braces(gbnf: str, pos: int) -> tuple[tuple[int, int | None] | None, int]:
    """The bounds of the repetition ``{m}``, ``{m,}`` or ``{m,n}`` whose "{" ends at ``pos`` (spaces,
    newlines and comments allowed around them, as llama.cpp's parser allows), and where it ends; None
    for what is not one. Reads each character once."""
    n = len(gbnf)

    def space(i: int) -> int:
        while i < n and (gbnf[i] in " \t\r\n" or gbnf[i] == "#"):
            if gbnf[i] != "#":
                i += 1
                continue
            end = _COMMENT_END.search(gbnf, i)  # "\r" or "\n", as llama.cpp's parse_space ends it
            if end is None:
                return n
            i = end.start()
        return i

    def number(i: int) -> tuple[int | None, int]:
        # all the digits, as llama.cpp's parse_int reads them (leading zeros and all); beyond 2,000
        # the value only matters as "above", so a long number is not converted
        j = i
        while j < n and gbnf[j] in "0123456789":
            j += 1
        digits = gbnf[i:j].lstrip("0") or ("0" if j > i else "")
        if not digits:
            return None, j
        return (int(digits) if len(digits) <= 9 else 10**9), j

    i = space(pos)
    low, i = number(i)
    if low is None:
        return None, i
    i = space(i)
    if i < n and gbnf[i] == "}":
        return (low, low), i + 1
    if i >= n or gbnf[i] != ",":
        return None, i
    i = space(i + 1)
    high, i = number(i)
    i = space(i)
    if i < n and gbnf[i] == "}":
        return (low, high), i + 1
    return None, i


def _logit_bias(given, n_vocab: int) -> tuple[tuple[int, float], ...]:
    items = given.items() if isinstance(given, dict) else given
    out = []
    for item in items:
        try:
            token, bias = item
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias entries must be (token, bias) pairs, got {item!r}") from None
        if isinstance(token, str) and token.lstrip("-").isdigit():
            token = int(token)  # JSON object keys are strings
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < n_vocab:
            raise ValueError(f"logit_bias token {token!r} is not in the vocabulary (0..{n_vocab - 1})")
        if bias is False:
            bias = -np.inf
        if isinstance(bias, bool) or not isinstance(bias, (int, float, np.number)) or np.isnan(bias):
            raise ValueError(f"logit_bias for token {token} must be a number (or false), got {bias!r}")
        out.append((int(token), float(bias)))
    return tuple(out)


_NUMPY_CHAIN = ("penalties", "top_k", "top_p", "min_p", "temperature")


@dataclasses.dataclass
class Dist:
    """One row's distribution: token ids and their probabilities (summing to 1)."""

    ids: np.ndarray  # int64 [m]
    probs: np.ndarray  # float64 [m]

    def prob_of(self, token: int) -> float:
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if len(hit) else 0.0

    def dense(self, n_vocab: int) -> np.ndarray:
        out = np.zeros(n_vocab)
        out[self.ids] = self.probs
        return out

    def sample(self, rng: np.random.Generator) -> int:
        return int(self.ids[min(np.searchsorted(np.cumsum(self.probs), rng.random() * self.probs.sum()),
                                len(self.ids) - 1)])


def penalize(x: np.ndarray, params: SamplingParams, recent: np.ndarray | None) -> None:
    """llama.cpp's penalties, in place on logits rows ``x`` [n, n_vocab]: each token among ``recent``
    (the last ``penalty_last_n`` tokens) has its logit divided by ``repeat_penalty`` (multiplied,
    when negative), then lowered by ``count * frequency_penalty + presence_penalty``."""
    if not params.penalized or recent is None or not len(recent):
        return
    recent = np.asarray(recent)
    if params.penalty_last_n > 0:
        recent = recent[-params.penalty_last_n:]
    ids, counts = np.unique(recent, return_counts=True)
    v = x[:, ids]
    if params.repeat_penalty != 1.0:
        v = np.where(v <= 0, v * params.repeat_penalty, v / params.repeat_penalty)
    x[:, ids] = v - counts * params.frequency_penalty - params.presence_penalty


def distributions(logits: np.ndarray, params: SamplingParams, recent: np.ndarray | None = None) -> list[Dist]:
    """The chain applied to each row of ``logits`` [n, n_vocab]; ``recent``: the tokens the
    penalties see (the sequence's generated tokens so far). Each row's tokens best first (ties by
    id, without top-k). O(n_vocab) a row and a sort of the tokens top-k, top-p or min-p leave (all
    of them when none of the three cuts)."""
    x = np.array(logits, dtype=np.float64, copy=True)
    n, n_vocab = x.shape
    if params.logit_bias:  # each entry adds, as llama.cpp's sampler applies them one by one
        ids, biases = zip(*params.logit_bias)
        np.add.at(x, (slice(None), np.asarray(ids)), np.asarray(biases))
    if "penalties" in params.samplers:
        penalize(x, params, recent)
    x[~np.isfinite(x)] = -np.inf  # a -inf bias forbids a token outright
    on = set(params.samplers)
    k = params.top_k if "top_k" in on and 0 < params.top_k < n_vocab else n_vocab
    if k == n_vocab:
        return [_untruncated(row, params, on) for row in x]
    ids = np.argpartition(-x, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(x, ids, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")  # candidates by logit, highest first
    ids, vals = np.take_along_axis(ids, order, axis=1), np.take_along_axis(vals, order, axis=1)
    # top-p and min-p see the candidates' softmax at temperature 1, as llama.cpp's chain does.
    p1 = np.exp(vals - vals[:, :1])
    p1 /= p1.sum(axis=1, keepdims=True)
    return _cut(ids, vals, p1, params, on)


def distributions_in_turn(logits: np.ndarray, params: SamplingParams, seen, tokens) -> list[Dist]:
    """The chain on consecutive rows of one sequence [n, n_vocab], as the native sampler takes their
    tokens one at a time: row i's penalties see ``seen`` (the tokens before the first row; its last
    penalty_last_n are enough) and then ``tokens[:i]``. All rows at once when nothing is penalized."""
    if not params.penalized:
        return distributions(logits, params)
    seen, tokens = np.asarray(seen, dtype=np.int64), np.asarray(tokens, dtype=np.int64)
    return [distributions(logits[i][None, :], params, np.concatenate([seen, tokens[:i]]))[0]
            for i in range(len(logits))]


#: Without top-k, the most likely tokens first looked at for top-p's cut (then 4x as many, ...).
_TOP_P_FIRST = 64


def _untruncated(row: np.ndarray, params: SamplingParams, on: set) -> Dist:
    """The chain on one row without top-k: the same as sorting the whole vocabulary, but only the
    tokens that can pass top-p and min-p are sorted. Both keep the best tokens down to a cut, so
    a threshold on exp(logit - max) found in O(n_vocab) (min-p's directly, top-p's from the best
    64, 256, ... tokens until they hold its mass) bounds them; the chain's own tests then decide,
    on those tokens, exactly as on the whole row (the thresholds keep a little margin)."""
    n_vocab = len(row)
    e = np.exp(row - row.max())  # the best token's is 1
    z = e.sum()
    floor = None  # every token the cut can keep has e >= floor
    if np.isfinite(z):
        if "min_p" in on and params.min_p > 0.0:
            floor = min(params.min_p, 1.0) * (1.0 - 1e-9)
        if "top_p" in on and params.top_p < 1.0:
            c = _TOP_P_FIRST
            while c < n_vocab:
                at = np.partition(e, n_vocab - c)[n_vocab - c]  # the c-th largest
                if floor is not None and at <= floor:
                    break  # min-p cuts within these already
                if e[e >= at].sum() >= (params.top_p + 1e-9) * z:  # a token below is past top-p's mass
                    floor = at
                    break
                c *= 4
    ids = np.arange(n_vocab) if floor is None else np.flatnonzero(e >= floor)
    vals = row[ids]
    order = np.argsort(-vals, kind="stable")  # ids ascending: ties stay in id order
    ids, vals = ids[order], vals[order]
    return _cut(ids[None], vals[None], (e[ids] / z)[None], params, on)[0]


def _cut(ids: np.ndarray, vals: np.ndarray, p1: np.ndarray, params: SamplingParams, on: set) -> list[Dist]:
    """Top-p, min-p and temperature on candidate rows ``ids`` [n, m] sorted by logit ``vals``,
    highest first, ``p1`` their probabilities at temperature 1 (over every candidate, these and
    any left out below them)."""
    keep = np.ones_like(vals, dtype=bool)
    if "top_p" in on and params.top_p < 1.0:
        before = np.cumsum(p1, axis=1) - p1  # mass of the better candidates
        keep &= before < params.top_p
    if "min_p" in on and params.min_p > 0.0:
        keep &= p1 >= params.min_p * p1[:, :1]
    keep[:, 0] = True  # min_keep = 1
    t = max(params.temperature, 1e-6) if "temperature" in on else 1.0
    out = []
    for r in range(len(vals)):
        v = vals[r][keep[r]] / t
        p = np.exp(v - v.max())
        out.append(Dist(ids[r][keep[r]].astype(np.int64), p / p.sum()))
    return out
