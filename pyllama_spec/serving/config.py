"""What an Engine is loaded with (``EngineConfig``, llama.cpp's option names) and its checks that
need no file and no native call (``EngineConfig.checked``, run once by the Engine before loading;
those that read the files are serving/load_plan.py's)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence, TypedDict

from pyllama_spec.drafters.registry import (
    METHODS,
    NgramSettings,
    canonical_spec_type,
    default_spec_type,
    method,
    methods,
)
from pyllama_spec.speculative.synthetic import check_settings


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str
    mmproj: str | None = None
    draft: str | None = None
    # the draft model's own projector (draft-simple: a small VLM that sees the pictures too). Not a
    # llama-server flag: its draft-simple is fed the target's image rows where the widths match
    mmproj_draft: str | None = None
    # llama.cpp's --spec-type (or an alias); None: the default for the files given, as load() picks it
    # (registry.default_spec_type: "draft-simple" with mmproj_draft, "draft-dflash" with a draft, else
    # "none"), set when the config is made
    spec_type: str | None = None
    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_gpu_layers: int = 0
    draft_n_gpu_layers: int | None = None
    # the most tokens one step drafts, or "auto": every request's length adapts (draft_length.py);
    # None: the method's measured default (registry Method.draft_max), or with a draft tree as deep as
    # the draft goes; set by checked()
    draft_max: int | str | None = None
    draft_min: int = 0
    # the n-gram types' own settings (--spec-ngram-*, -lcs/-lcd); a NgramSettings or a dict of its fields
    ngram: NgramSettings | Mapping[str, Any] = NgramSettings()
    # spec_type "draft-python": a function proposing tokens (input_ids -> token ids; llama-cpp-python's
    # LlamaDraftModel); None otherwise
    draft_callable: Any = None
    draft_p_min: float = 0.0
    draft_positions: str = "target"
    # > 0: verify a tree of up to this many drafted tokens per step instead of one chain (tree.py;
    # DFlash drafts, one sequence, llama.cpp's "match" rule: the same tokens as target-only for a seed)
    draft_tree: int = 0
    # At temperature > 0: llama.cpp's exact "match" (the default until rejection sampling's gain is
    # consistent: see bench/RESULTS.md), or "rejection" sampling.
    verify: str = "match"
    # llama-server's --spec-synth-rates / --spec-synth-len, for benchmarks only: drafts kept at these
    # rates (one per drafted position) or at this mean acceptance length, not by the target, so the
    # text is not the model's (speculative/synthetic.py)
    synth_rates: Sequence[float] = ()
    synth_len: float | None = None
    flash_attn: bool | None = False
    # The projector's flash attention: None (auto, llama-server's default) where the target's stays off.
    # Speculative output stays target-only's whatever it is (the target and its drafts read the same
    # embeddings), though the embeddings, and so the text, may differ slightly from a run with it off;
    # 2.6x faster encodes on this CPU (bench/RESULTS.md). llama-server's -fa sets both; the CLI's too.
    mmproj_flash_attn: bool | None = None
    n_threads: int | None = None
    n_threads_batch: int | None = None
    swa_full: bool = False
    # llama.cpp's -ctk / -ctv (and -ctkd / -ctvd for the draft; None: as the target's)
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    cache_type_k_draft: str | None = None
    cache_type_v_draft: str | None = None
    use_mmap: bool = True  # --no-mmap
    use_mlock: bool = False  # --mlock
    mmproj_offload: bool | None = None  # --(no-)mmproj-offload; None: on when layers are offloaded
    # llama.cpp's -np: sequences (slots) served at once, each with n_ctx / n_parallel cache rows;
    # above 1, generations run concurrently in the slot loop's thread (slot_loop.py, Engine.submit)
    n_parallel: int = 1
    # llama-server's --cache-ram: MiB of host memory for slots' caches a request would otherwise
    # overwrite, restored when a later prompt shares more with one of them (serving/prompt_cache.py);
    # 0: none (the default here; serve's is llama-server's 8192), -1: no size limit. cache_idle_slots
    # (--cache-idle-slots): also copy every idle slot there whenever a request starts.
    cache_ram_mib: int = 0
    cache_idle_slots: bool = True
    # llama-server's --kv-unified: one pool of n_ctx cache cells for every slot, each slot taking
    # what it needs (a prompt may use the whole context) instead of n_ctx / n_parallel of its own.
    # The slot loop shares the cells out (slot_loop.py: idle slots give theirs up first).
    kv_unified: bool = False
    # Devices (devices.py; llama.cpp's --rpc, -dev, -devd, -sm, -ts, -mg): RPC servers' host:port, the
    # target's devices by name (None: llama.cpp's choice, remote ones first; "none": no offload), the
    # draft's (None: this machine's), the split mode, a proportion per device, the main device.
    rpc_servers: Sequence[str] | str = ()
    devices: Sequence[str] | str | None = None
    device_draft: Sequence[str] | str | None = None
    split_mode: str = "layer"
    tensor_split: Sequence[float] | str = ()
    main_gpu: int = 0
    # Every request's sampling defaults, llama-server's --temp, --top-k, ... (SamplingParams fields,
    # seed and json_schema); a request's own settings override them.
    sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # llama-server's --chat-template(-file): a Jinja template, or the name of one of llama.cpp's
    # built-in templates ("chatml", "llama3", ...), used instead of the model's own.
    chat_template: str | None = None
    jinja: bool = True  # False (--no-jinja): llama.cpp's built-in renderer, never Jinja
    # llama-server's other chat flags (serving/chat_template.py's ChatSettings): --chat-template-kwargs
    # (name -> JSON value), --reasoning on|off|auto, --reasoning-format, --reasoning-budget(-message),
    # --reasoning-effort, --(no-)reasoning-preserve, --(no-)prefill-assistant, --skip-chat-parsing
    chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    reasoning: str = "auto"
    reasoning_format: str = "deepseek"
    reasoning_budget: int = -1
    reasoning_budget_message: str = ""
    reasoning_effort: str | None = None
    reasoning_preserve: bool | None = None
    prefill_assistant: bool = True
    skip_chat_parsing: bool = False
    # LoRA adapters of the target (llama-server's --lora FILE / --lora-scaled FILE:SCALE): paths or
    # (path, scale) pairs, ids in this order; lora_init_without_apply (--lora-init-without-apply)
    # starts every global scale at 0 until set_scales (POST /lora-adapters). See serving/lora.py.
    lora: Sequence[str | tuple[str, float]] = ()
    lora_init_without_apply: bool = False
    # Embeddings (llama-server's --embeddings, --pooling, --embd-normalize; serving/embeddings.py):
    # whether Engine.embed may run; how a prompt's rows are pooled into one vector ("unspecified":
    # as the GGUF declares, "none": a vector per row); the default normalisation of pooled vectors
    # (-1 none, 0 max-abs to int16, 1 taxicab, 2 euclidean, >2 p-norm).
    embeddings: bool = False
    pooling: str = "unspecified"
    embd_normalize: int = 2

    def __post_init__(self) -> None:
        if self.spec_type is None:
            object.__setattr__(self, "spec_type", default_spec_type(self.draft, self.mmproj_draft))

    def checked(self) -> "EngineConfig":
        """This configuration with its spec_type in llama.cpp's name ("dflash" -> "draft-dflash"),
        after every check that needs no file and no native call (ValueError naming the setting):
        the method's draft file and draft projector, batch sizes, draft_max, n_parallel, the draft
        tree. The Engine runs it once, before loading anything."""
        ngram = self.ngram if isinstance(self.ngram, NgramSettings) else NgramSettings(**dict(self.ngram))
        ngram = NgramSettings(**{**dataclasses.asdict(ngram), "map_k": tuple(ngram.map_k),
                                 "map_k4v": tuple(ngram.map_k4v)})
        c = dataclasses.replace(self, spec_type=canonical_spec_type(self.spec_type), ngram=ngram)
        if any(m.ngram_family for m in methods(c.spec_type)):
            ngram.checked()  # only where an n-gram type reads them (the flags are accepted otherwise, as there)
        m = method(c.spec_type)
        if m is not None and m.draft_file and c.draft is None:
            raise ValueError(f"spec_type={c.spec_type!r} needs a draft model (draft=...)")
        if c.mmproj_draft is not None and not (m and m.draft_projector and c.draft):
            takes = " or ".join(repr(t.name) for t in METHODS if t.draft_projector)
            raise ValueError(f"mmproj_draft is a draft model's own projector: it needs a draft model (draft=...) "
                             f"and spec_type {takes}, got spec_type {c.spec_type!r}")
        if c.n_ubatch > c.n_batch:
            raise ValueError(f"n_ubatch ({c.n_ubatch}) cannot exceed n_batch ({c.n_batch})")
        check_pooling(c.pooling, c.embd_normalize)
        if c.draft_max is None:  # the method's measured length; a tree's depth as before: the draft's cap
            c = dataclasses.replace(c, draft_max=0 if m is None else DRAFT_TREE_DEPTH if c.draft_tree else m.draft_max)
        dm = c.draft_max
        if dm is None and m is not None and m.draft_max is None:
            pass  # the method's own length: plan_drafts gives it
        elif dm != "auto" and (isinstance(dm, bool) or not isinstance(dm, int) or dm < 0):
            raise ValueError(f'draft_max must be an integer >= 0 or "auto", got {dm!r}')
        if isinstance(c.cache_ram_mib, bool) or not isinstance(c.cache_ram_mib, int) or c.cache_ram_mib < -1:
            raise ValueError(f"cache_ram_mib must be an integer >= -1 (MiB; 0: no prompt cache, -1: no limit), "
                             f"got {c.cache_ram_mib!r}")
        if isinstance(c.n_parallel, bool) or not isinstance(c.n_parallel, int) or c.n_parallel < 1:
            raise ValueError(f"n_parallel must be an integer >= 1, got {c.n_parallel!r}")
        if c.n_parallel > c.n_batch:
            raise ValueError(f"n_parallel ({c.n_parallel}) cannot exceed n_batch ({c.n_batch}): every "
                             "slot's verify rows go in one target batch")
        _check_draft_tree(c)
        _check_synthetic(c)
        return c


class LoadOptions(TypedDict, total=False):
    """``load()``'s keywords (``EngineConfig``'s settings, and ``n_gpu_layers_draft`` / ``verbose``), typed
    so that editors complete and check them (``load(**kwargs: Unpack[LoadOptions])``). Each means what
    the EngineConfig field of its name means; tests/test_engine_defaults.py keeps the two in step."""

    mmproj_draft: str | None
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_gpu_layers: int
    draft_n_gpu_layers: int | None
    n_gpu_layers_draft: int | None  # llama.cpp's name (-ngld) for draft_n_gpu_layers
    draft_max: int | str | None
    draft_min: int
    ngram: NgramSettings | Mapping[str, Any]
    draft_callable: Any
    draft_p_min: float
    draft_positions: str
    draft_tree: int
    verify: str
    synth_rates: Sequence[float]
    synth_len: float | None
    flash_attn: bool | None
    mmproj_flash_attn: bool | None
    n_threads: int | None
    n_threads_batch: int | None
    swa_full: bool
    cache_type_k: str
    cache_type_v: str
    cache_type_k_draft: str | None
    cache_type_v_draft: str | None
    use_mmap: bool
    use_mlock: bool
    mmproj_offload: bool | None
    n_parallel: int
    cache_ram_mib: int
    cache_idle_slots: bool
    kv_unified: bool
    rpc_servers: Sequence[str] | str
    devices: Sequence[str] | str | None
    device_draft: Sequence[str] | str | None
    split_mode: str
    tensor_split: Sequence[float] | str
    main_gpu: int
    sampling: Mapping[str, Any]
    chat_template: str | None
    jinja: bool
    chat_template_kwargs: Mapping[str, Any]
    reasoning: str
    reasoning_format: str
    reasoning_budget: int
    reasoning_budget_message: str
    reasoning_effort: str | None
    reasoning_preserve: bool | None
    prefill_assistant: bool
    skip_chat_parsing: bool
    lora: Sequence[str | tuple[str, float]]
    lora_init_without_apply: bool
    embeddings: bool
    pooling: str
    embd_normalize: int
    verbose: bool  # llama.cpp's log on standard error, as llama-cpp-python's verbose=True


#: llama-server's --pooling names (bindings/context.py's POOLING_TYPES, which must hold the same).
POOLING_NAMES = ("unspecified", "none", "mean", "cls", "last", "rank")


def check_pooling(pooling: str, embd_normalize: int) -> None:
    if pooling not in POOLING_NAMES:
        raise ValueError(f"pooling must be one of {', '.join(POOLING_NAMES)}, got {pooling!r}")
    if isinstance(embd_normalize, bool) or not isinstance(embd_normalize, int) or embd_normalize < -1:
        raise ValueError(f"embd_normalize must be an integer >= -1 (-1 none, 0 max-abs, 1 taxicab, 2 euclidean, "
                         f">2 p-norm), got {embd_normalize!r}")


#: The most drafted tokens in a tree: each leaf takes a sequence id, and llama.cpp has 256.
DRAFT_TREE_LIMIT = 255
#: A tree's depth when no draft_max is given: 16, which the draft caps to what it can reach (15 for a
#: DFlash block of 16), as the default was before the per-method lengths.
DRAFT_TREE_DEPTH = 16


def _check_draft_tree(c: EngineConfig) -> None:
    """Refuse, before loading, a draft tree the engine cannot verify."""
    t = c.draft_tree
    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= DRAFT_TREE_LIMIT:
        raise ValueError(f"draft_tree must be an integer from 0 to {DRAFT_TREE_LIMIT}, got {t!r}")
    if not t:
        return
    m = method(c.spec_type)
    if m is None or not m.trees:
        trees = [t for t in METHODS if t.trees]
        raise ValueError(f"draft_tree needs {' or '.join(t.title for t in trees)} (spec_type "
                         f"{', '.join(repr(t.name) for t in trees)}), whose drafts carry the draft's distribution "
                         f"at every position; got spec_type {c.spec_type!r}" + (f" ({m.title})" if m else ""))
    if t + 1 > c.n_batch:
        raise ValueError(f"draft_tree {t} needs n_batch >= {t + 1}: the whole tree and its root are verified "
                         f"in one target batch (n_batch is {c.n_batch})")
    if c.n_parallel != 1:
        raise ValueError("draft_tree works with one sequence (n_parallel=1): its branches use the "
                         "sequence ids that slots would")
    check_tree_settings(c.draft_max, c.verify)


def check_tree_settings(draft_max, verify: str) -> None:
    """What a tree needs of the draft settings, at load and for each call that uses one."""
    if draft_max == "auto":
        raise ValueError('draft_tree needs a fixed draft_max (the tree\'s depth), not "auto"')
    if verify == "rejection":
        raise ValueError('draft_tree verifies with the "match" rule; rejection sampling over a tree is '
                         'not implemented (pass draft_tree=0 or verify="match")')


def _check_synthetic(c: EngineConfig) -> None:
    """Synthetic acceptance's checks that need no drafter (the count of rates needs its draft length:
    the Engine checks it once the drafter is made)."""
    if not c.synth_rates and c.synth_len is None:
        return
    check_settings([float(r) for r in c.synth_rates], c.synth_len)
    if method(c.spec_type) is None:
        raise ValueError("synthetic acceptance (synth_rates, synth_len) needs a drafter: a spec_type other than "
                         "'none'")
    if c.draft_tree:
        raise ValueError("synthetic acceptance keeps drafts of a chain at random; a draft tree is verified by the "
                         "target's own tokens: set draft_tree=0 or leave synth_rates and synth_len out")
