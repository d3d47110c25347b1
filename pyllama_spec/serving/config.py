"""What an Engine is loaded with (``EngineConfig``, llama.cpp's option names) and the checks of a
configuration that need no file and no native call (the draft tree's settings)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from pyllama_spec.drafters.registry import METHODS, method


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str
    mmproj: str | None = None
    draft: str | None = None
    # the draft model's own projector (draft-simple: a small VLM that sees the pictures too). Not a
    # llama-server flag: its draft-simple is fed the target's image rows where the widths match
    mmproj_draft: str | None = None
    spec_type: str = "dflash"
    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_gpu_layers: int = 0
    draft_n_gpu_layers: int | None = None
    draft_max: int | str = 16  # or "auto": every request's length adapts (draft_length.py)
    draft_min: int = 0
    draft_p_min: float = 0.0
    draft_positions: str = "target"
    # > 0: verify a tree of up to this many drafted tokens per step instead of one chain (tree.py;
    # DFlash drafts, one sequence, llama.cpp's "match" rule: the same tokens as target-only for a seed)
    draft_tree: int = 0
    # At temperature > 0: llama.cpp's exact "match" (the default until rejection sampling's gain is
    # consistent: see bench/RESULTS.md), or "rejection" sampling.
    verify: str = "match"
    flash_attn: bool | None = False
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
    # above 1, generations run concurrently through Engine.submit (scheduler.py)
    n_parallel: int = 1
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
    # llama-server's other chat flags (serving/prompt.py's ChatSettings): --chat-template-kwargs
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


#: The most drafted tokens in a tree: each leaf takes a sequence id, and llama.cpp has 256.
DRAFT_TREE_LIMIT = 255


def _check_draft_tree(c: EngineConfig) -> None:
    """Refuse, before loading, a draft tree the engine cannot verify."""
    t = c.draft_tree
    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= DRAFT_TREE_LIMIT:
        raise ValueError(f"draft_tree must be an integer from 0 to {DRAFT_TREE_LIMIT}, got {t!r}")
    if not t:
        return
    m = method(c.spec_type)
    if m is None or not m.trees:
        trees = ", ".join(repr(t.name) for t in METHODS if t.trees)
        raise ValueError(f"draft_tree needs a DFlash draft (spec_type {trees}), whose block gives the "
                         f"draft's distribution at every position; got spec_type {c.spec_type!r}")
    if t + 1 > c.n_batch:
        raise ValueError(f"draft_tree {t} needs n_batch >= {t + 1}: the whole tree and its root are verified "
                         f"in one target batch (n_batch is {c.n_batch})")
    if c.n_parallel != 1:
        raise ValueError("draft_tree works with one sequence (n_parallel=1): its branches use the "
                         "sequence ids that slots would")
    _check_tree_settings(c.draft_max, c.verify)


def _check_tree_settings(draft_max, verify: str) -> None:
    """What a tree needs of the draft settings, at load and for each call that uses one."""
    if draft_max == "auto":
        raise ValueError('draft_tree needs a fixed draft_max (the tree\'s depth), not "auto"')
    if verify == "rejection":
        raise ValueError('draft_tree verifies with the "match" rule; rejection sampling over a tree is '
                         'not implemented (pass draft_tree=0 or verify="match")')
