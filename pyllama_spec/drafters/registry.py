"""The speculative methods, one entry each: what the engine needs to know of a method, said once.

An entry names the method (llama.cpp's ``--spec-type`` name and aliases), whether it needs a
draft file, what it reads of the target's decodes, whether it computes with the target's output
head (so the head must stay where its context can reach it), whether a draft tree can be built
from its drafts, and how messages call it. Its module (imported only when the method is used, so
that the names are known before the native part is built) gives:

* ``memory_parts(settings: MemorySettings) -> list[memory.Part]``: what the method adds to the
  memory estimate, from the files alone (its draft's weights, caches and compute buffer, its draft's
  own projector, a head's context); ``load()`` refuses a configuration that does not fit, and
  ``pyllama-spec doctor`` prints them;
* ``check_pair(target, draft, build_record) -> Pairing``: refuse, before any context exists, a
  pairing that cannot work; say how far one draft may go and whether it has per-position logits;
* ``make(setup: DrafterSetup) -> Drafter``.

Adding a method is one module and one entry here; the engine does not change.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from pyllama_spec.drafters import Drafter


@dataclasses.dataclass(frozen=True)
class Pairing:
    """What checking a target and its draft found."""

    limit: int  # the most tokens one draft may propose (n_max_limit)
    per_position_logits: bool  # the draft's distribution at every drafted position (trees, rejection)
    data: Any = None  # the method's own facts for make() (e.g. a DFlashConfig)
    target_layers: tuple[int, ...] = ()  # "layer inputs": the target layers whose inputs it reads


#: The most tokens an n-gram method's own settings may let one draft propose (--spec-ngram-*-size-m,
#: --spec-ngram-mod-n-max): its pairing's limit; each drafter then holds to its own setting.
NGRAM_DRAFT_LIMIT = 256


@dataclasses.dataclass(frozen=True)
class NgramSettings:
    """The n-gram methods' own settings: llama-server's flags and defaults (common/common.h).

    ``map_k`` / ``map_k4v``: (size_n, size_m, min_hits) of ``--spec-ngram-map-k(4v)-size-n / -size-m
    / -min-hits``; ``mod_*``: ``--spec-ngram-mod-n-match / -n-min / -n-max``; ``lookup_cache_static``
    / ``lookup_cache_dynamic``: ngram-cache's files (``-lcs`` / ``-lcd``, made by llama.cpp's
    ``llama-lookup-create``)."""

    map_k: tuple[int, int, int] = (12, 48, 1)
    map_k4v: tuple[int, int, int] = (12, 48, 1)
    mod_n_match: int = 24
    mod_n_min: int = 48
    mod_n_max: int = 64
    lookup_cache_static: str | None = None
    lookup_cache_dynamic: str | None = None

    def checked(self) -> "NgramSettings":
        for name in ("map_k", "map_k4v"):
            size_n, size_m, min_hits = getattr(self, name)
            if not (1 <= size_n <= 1024 and 1 <= size_m <= NGRAM_DRAFT_LIMIT and 0 <= min_hits <= 16380):
                raise ValueError(f"ngram {name} needs 1 <= size_n <= 1024, 1 <= size_m <= {NGRAM_DRAFT_LIMIT} and "
                                 f"0 <= min_hits <= 16380, got {getattr(self, name)}")
        # as llama.cpp, n_min above n_max is taken: then only a walk that reaches n_max drafts
        if not (1 <= self.mod_n_match <= 1024 and 0 <= self.mod_n_min <= NGRAM_DRAFT_LIMIT
                and 1 <= self.mod_n_max <= NGRAM_DRAFT_LIMIT):
            raise ValueError(f"ngram-mod needs 1 <= n_match <= 1024, 0 <= n_min <= {NGRAM_DRAFT_LIMIT} and "
                             f"1 <= n_max <= {NGRAM_DRAFT_LIMIT}, got n_match {self.mod_n_match}, n_min "
                             f"{self.mod_n_min}, n_max {self.mod_n_max}")
        return self


def ngram_limit(spec_type: str, ngram: NgramSettings) -> int | None:
    """The most tokens one draft of an n-gram type may propose under its settings (its size_m, its
    n_max, ngram-cache's 8); None for any other type. Recurrent targets keep a state snapshot per
    position a draft may roll back, so the plan must not take NGRAM_DRAFT_LIMIT for it."""
    return {"ngram-map-k": ngram.map_k[1], "ngram-map-k4v": ngram.map_k4v[1], "ngram-mod": ngram.mod_n_max,
            "ngram-cache": 8}.get(spec_type)


@dataclasses.dataclass(frozen=True)
class DrafterSetup:
    """Everything ``make`` may use: the target's context, the draft model (None without a file),
    the pairing, the engine's settings for drafts and the draft's context, and the draft's own
    projector (a vision draft model)."""

    target_ctx: Any
    draft_model: Any
    pairing: Pairing
    n_max: int
    n_min: int
    p_min: float
    n_seq: int
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_threads: int | None
    flash_attn: bool | None
    swa_full: bool
    cache_types: dict
    draft_projector: Any = None  # the draft model's own projector (draft-simple with mmproj_draft), or None
    ngram: NgramSettings = NgramSettings()  # the n-gram methods' own settings
    draft_callable: Any = None  # draft-python's function (input_ids -> token ids)
    method_name: str = ""  # the entry being made (two entries may share a module: ngram-map-k, -k4v)


@dataclasses.dataclass(frozen=True)
class MemorySettings:
    """What a method's memory parts are estimated from, before anything is loaded: its files (paths;
    None where not given) and the load's settings, the draft's cache types resolved (as the target's
    unless given)."""

    target: str
    draft: str | None
    mmproj_draft: str | None
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_seq: int
    cache_type_k: str
    cache_type_v: str


@dataclasses.dataclass(frozen=True)
class Method:
    name: str  # llama.cpp's --spec-type name
    module: str  # the module implementing memory_parts, check_pair and make
    title: str = "a draft"  # what messages call it: "needs a DFlash draft", "the target with an EAGLE3 draft"
    aliases: tuple[str, ...] = ()
    draft_file: bool = True  # needs a draft model (-md)
    target_features: str = "none"  # what it reads of each target decode: "layer inputs", "final hidden state" or "none"
    uses_target_head: bool = False  # computes with the target's token embedding and output head
    trees: bool = False  # a draft tree can be built from its drafts (with per-position logits)
    loads_target_mtp: bool = False  # the target is loaded with its multi-token-prediction (nextn) block
    draft_projector: bool = False  # its draft model may take a projector of its own (mmproj_draft: it sees pictures)
    #: What its drafts see a picture in the prompt through, and under which setting (measured:
    #: bench/RESULTS.md "Drafting that sees the picture"); "" where they never see one.
    sees_picture: str = ""
    #: The draft length used when none is given (draft_max=None, no --spec-draft-n-max): the fixed
    #: length measured fastest for the method, on text and after a picture, in both trained worlds
    #: (bench/RESULTS.md "Default draft lengths", and for the token-by-token drafters, drafting their
    #: chain natively, "Drafting token by token in one native call"). llama-server's is 3 for every
    #: method with a draft model.
    #: None: the method's own setting (the n-gram maps' size_m, ngram-mod's n_max, ngram-cache's 8).
    draft_max: int | None = 3
    ngram_family: bool = False  # an n-gram method: it may go before another in a list (llama.cpp's order)
    python_only: bool = False  # takes a Python object (load's draft_callable): no command-line flag names it

    def _impl(self):
        return importlib.import_module(self.module)

    def memory_parts(self, settings: MemorySettings) -> list:
        """What this method adds to the memory estimate (gguf/memory.py ``Part``s), from the files alone."""
        return self._impl().memory_parts(settings)

    def check_pair(self, target, draft, build_record: dict) -> Pairing:
        return self._impl().check_pair(target, draft, build_record)

    def make(self, setup: DrafterSetup) -> Drafter:
        return self._impl().make(setup)

    def open_target_features(self, target_ctx, pairing: Pairing) -> None:
        """Turn on, on the target's context, what this method reads of every decode (before
        anything is decoded): the drafter receives it in each ``TargetDecode``."""
        if self.target_features == "layer inputs":
            target_ctx.enable_layer_inputs(pairing.target_layers)
        elif self.target_features == "final hidden state":
            # every row's (not only the output rows'): an MTP head pairs each token with the row before it
            target_ctx.enable_draft_embeddings(True, masked=False)


METHODS = (
    Method("draft-dflash", "pyllama_spec.drafters.dflash", "a DFlash draft", aliases=("dflash",),
           target_features="layer inputs", uses_target_head=True, trees=True, draft_max=5,
           sees_picture="the target's layer inputs of the picture's rows, injected at consecutive positions with "
                        "draft_positions='sequential' (the default 'target' leaves pinned rows out)"),
    Method("draft-dspark", "pyllama_spec.drafters.dspark", "a DSpark draft", aliases=("dspark",),
           target_features="layer inputs", uses_target_head=True, draft_max=5,
           sees_picture="the target's layer inputs of the picture's rows, as DFlash"),
    Method("draft-eagle3", "pyllama_spec.drafters.eagle3", "an EAGLE3 draft", aliases=("eagle3",),
           target_features="layer inputs", uses_target_head=True, draft_max=5,
           sees_picture="the target's layer inputs of the picture's rows, written into its own cache"),
    Method("draft-simple", "pyllama_spec.drafters.draft_model", "a draft model", draft_projector=True,
           draft_max=5,
           sees_picture="its own projector, given mmproj_draft (blind without one)"),
    # n-gram: 3, 5 and 7 within the machine's spread on text that rarely repeats; where text repeats
    # (its use) longer drafts are kept whole, and llama-server's ngram-simple goes up to 48
    Method("ngram-simple", "pyllama_spec.drafters.ngram", "n-gram lookup", draft_file=False,
           draft_max=5, ngram_family=True),
    Method("ngram-map-k", "pyllama_spec.drafters.ngram_map", "an n-gram map (keys)", draft_file=False,
           draft_max=None, ngram_family=True),
    Method("ngram-map-k4v", "pyllama_spec.drafters.ngram_map", "an n-gram map (keys and values)", draft_file=False,
           draft_max=None, ngram_family=True),
    Method("ngram-mod", "pyllama_spec.drafters.ngram_mod", "a hashed n-gram table", draft_file=False,
           draft_max=None, ngram_family=True),
    Method("ngram-cache", "pyllama_spec.drafters.ngram_cache", "n-gram caches", draft_file=False,
           draft_max=None, ngram_family=True),
    Method("draft-python", "pyllama_spec.drafters.python_callable", "a Python draft function", draft_file=False,
           draft_max=None, python_only=True),
    Method("draft-mtp", "pyllama_spec.drafters.mtp", "its own MTP head", draft_file=False,
           target_features="final hidden state", loads_target_mtp=True, draft_max=5,
           sees_picture="the picture's rows in the head's own cache, each image embedding beside the target's hidden "
                        "state of the row before (llama.cpp leaves them out; so does a build without "
                        "patches/0004-mtp-media-rows.patch)"),
)
_BY_NAME = {name: m for m in METHODS for name in (m.name, *m.aliases)}

#: Every spec_type name accepted ("none": target only), aliases included.
SPEC_TYPES = ("none", *_BY_NAME)
#: The names a command line may give (--spec-type): not those that take a Python object.
CLI_SPEC_TYPES = ("none", *(name for name, m in _BY_NAME.items() if not m.python_only))


#: The tensor of DSpark's Markov head: llama.cpp tells draft-dspark files from draft-dflash ones by it.
MARKOV_HEAD_TENSOR = "markov_w1.weight"

#: llama.cpp's priority order (common/speculative.cpp common_speculative_init): of several types
#: given, the n-gram ones are tried first, in this order, and the first that drafts wins.
PRIORITY = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache",
            "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark", "draft-python")


def canonical_spec_type(spec_type: str) -> str:
    """llama.cpp's name for ``spec_type`` ("dflash" -> "draft-dflash"); a comma list (llama-server's
    ``--spec-type ngram-mod,draft-mtp``) in llama.cpp's priority order, each type once ("none" in a
    list adds nothing, as in common_speculative_init; only "none": none). ValueError for an unknown
    name, or for two methods that each need the draft."""
    names = [n.strip() for n in str(spec_type).split(",") if n.strip()]
    if not names:
        raise ValueError(f"spec_type must be one of {SPEC_TYPES} or a comma list of them, got {spec_type!r}")
    for n in names:
        if n != "none" and n not in _BY_NAME:
            raise ValueError(f"spec_type must be one of {SPEC_TYPES} or a comma list of them, got {n!r}")
    names = [n for n in names if n != "none"]
    if not names:
        return "none"
    chosen = list(dict.fromkeys(_BY_NAME[n].name for n in names))
    ordered = sorted(chosen, key=lambda n: PRIORITY.index(n) if n in PRIORITY else len(PRIORITY))
    drafts = [n for n in ordered if not _BY_NAME[n].ngram_family]
    if len(drafts) > 1:
        # llama-server accepts such a list but gives every draft type its one draft context: on the same
        # files it answers 500 ("failed to process speculative batch"), aborts, or stops drafting
        raise ValueError(f"spec_type {spec_type!r} names {' and '.join(drafts)}: one method with a draft or head "
                         "at a time (n-gram types may go before it); llama-server shares one draft context "
                         "between such types, and fails on them")
    return ",".join(ordered)


def default_spec_type(draft, mmproj_draft=None) -> str:
    """The method used when none is named: a draft with a projector of its own is a vision draft
    model ("draft-simple"); a draft file says what it is, as llama.cpp reads it
    (common_speculative_types_from_gguf): a DFlash file with a Markov head is DSpark's, an EAGLE3
    file EAGLE3's; any other draft a DFlash draft ("draft-dflash": its checks then say what the file
    is); no draft, none ("none")."""
    if draft is None:
        return "none"
    if mmproj_draft:
        return "draft-simple"
    try:
        from pyllama_spec.gguf.reader import read_gguf_shared

        info = read_gguf_shared(draft)
    except Exception:  # noqa: BLE001 - an unreadable file: the load's own check says what is wrong
        return "draft-dflash"
    if info.arch == "dflash" and MARKOV_HEAD_TENSOR in info.tensors:
        return "draft-dspark"
    return "draft-eagle3" if info.arch == "eagle3" else "draft-dflash"


#: Draft files whose architecture says which method reads them (any other is a draft model's).
_METHOD_OF_DRAFT_ARCH = {"dflash": "draft-dflash", "eagle3": "draft-eagle3"}


def wrong_draft_kind(draft_name: str, arch: str, wanted: str) -> str:
    """What to say when a draft file of architecture ``arch`` was given to method ``wanted``, with the
    setting that reads it, in the API's words and the command line's."""
    m = _BY_NAME[_METHOD_OF_DRAFT_ARCH.get(arch, "draft-simple")]
    kind = f"{m.title} ({arch!r})" if arch in _METHOD_OF_DRAFT_ARCH else f"a {arch!r} model ({m.title})"
    return (f"the draft {draft_name} is {kind}, not {_BY_NAME[wanted].title}: load it with spec_type={m.name!r} "
            f"(--spec-type {m.name})")


def methods(spec_type: str) -> tuple[Method, ...]:
    """The entries of ``spec_type`` in priority order (none for "none")."""
    name = canonical_spec_type(spec_type)
    return () if name == "none" else tuple(_BY_NAME[n] for n in name.split(","))


def method(spec_type: str) -> Method | None:
    """The entry that decides how ``spec_type`` loads (None for "none"): of a list, the method with a
    draft or head, else the first n-gram type; the others are n-gram drafters tried before it."""
    found = methods(spec_type)
    return next((m for m in found if not m.ngram_family), found[0] if found else None)
