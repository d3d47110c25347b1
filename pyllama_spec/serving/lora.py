"""An engine's LoRA adapters, as llama-server serves them (``--lora``, ``--lora-scaled``,
``--lora-init-without-apply``, GET/POST /lora-adapters, a request's ``lora`` field).

The adapters are loaded against the target and applied to the target context only. A draft
needs none: it only proposes tokens, and the target, decoding with the adapters, accepts
exactly the tokens it would have produced itself, so the output is the adapted target's (a
draft that knows nothing of the adapter is accepted less often, never followed blindly).

Each adapter has an id (its place on the command line), and the engine one scale per
adapter: the global scales (1.0, or the ``--lora-scaled`` value; 0 with
``lora_init_without_apply``), which POST /lora-adapters replaces. A request runs with its own
``lora`` list (``[{"id": 0, "scale": 0.5}]``; adapters it does not name get 0), or with the
global scales when it gives none. As in llama-server (server-context.cpp):

* a slot's cached prompt is kept only for a request with the same scales as the one that
  decoded it (llama-server's ``lora_should_clear_cache``; its aLoRA exception does not arise,
  aLoRA adapters are refused at load);
* one target decode runs under one set of scales, so only slots whose scales are equal are
  batched together (its ``can_batch_with``): the slot loop steps each set of slots in turn.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from pyllama_spec.bindings.lora import LoraAdapter

if TYPE_CHECKING:
    from pyllama_spec.bindings.context import Context
    from pyllama_spec.bindings.model import Model
    from pyllama_spec.speculative.sequence import Sequence as Slot

#: One adapter of the engine's configuration: (path, scale).
LoraSpec = tuple[str, float]


def lora_specs(lora: Any) -> tuple[LoraSpec, ...]:
    """EngineConfig.lora as (path, scale) pairs: a path, a (path, scale) pair, or a list of
    either (llama-server's ``--lora FILE`` is scale 1, ``--lora-scaled FILE:SCALE`` the scale)."""
    if lora is None:
        return ()
    if isinstance(lora, (str, bytes)) or hasattr(lora, "__fspath__") or _is_pair(lora):
        lora = [lora]
    out = []
    for item in lora:
        path, scale = item if _is_pair(item) else (item, 1.0)
        if isinstance(path, bytes) or not (isinstance(path, str) or hasattr(path, "__fspath__")):
            raise ValueError(f"lora entries are paths or (path, scale) pairs, got {item!r}")
        out.append((str(path), _scale(scale, f"the scale of the LoRA adapter {path}")))
    return tuple(out)


def _is_pair(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], numbers.Real)


def _scale(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


class EngineAdapters:
    """The LoRA adapters of one engine (see the module docstring); an empty set without ``--lora``.

    >>> engine.lora.info()                                        # doctest: +SKIP
    [{'id': 0, 'path': 'adapter.gguf', 'scale': 1.0, 'task_name': '', 'prompt_prefix': ''}]
    >>> engine.lora.set_scales([{"id": 0, "scale": 0.5}])       # doctest: +SKIP
    """

    def __init__(self, model: "Model | None" = None, specs: Sequence[LoraSpec] = (),
                 init_without_apply: bool = False) -> None:
        self.adapters: list[LoraAdapter] = []
        try:
            for path, _ in specs:
                self.adapters.append(LoraAdapter(model, path))
        except BaseException:
            self.close()
            raise
        #: The global scales, one per adapter: what a request without ``lora`` runs with.
        self.scales: tuple[float, ...] = tuple(0.0 if init_without_apply else s for _, s in specs)
        # The scales each slot's cached prompt was decoded with, by sequence id (a slot that ran
        # nothing yet holds what the load's scales would give it)
        self._cached: dict[int, tuple[float, ...]] = {}
        self._initial = self.scales

    def __len__(self) -> int:
        return len(self.adapters)

    def close(self) -> None:
        for a in self.adapters:
            a.close()

    # ------------------------------------------------------------------ llama-server's API
    def info(self) -> list[dict]:
        """GET /lora-adapters' body: each adapter's id, path (as given), global scale, and its
        file's task_name and prompt_prefix. Pure Python: safe while a generation runs."""
        scales = self.scales
        return [{"id": i, "path": a.path, "scale": scales[i], "task_name": a.task_name,
                 "prompt_prefix": a.prompt_prefix} for i, a in enumerate(self.adapters)]

    def set_scales(self, lora) -> None:
        """POST /lora-adapters: the global scales become those of ``lora`` (``resolve``'s
        argument; adapters it does not name get 0). Requests that start later use them."""
        self.scales = self.resolve(lora)

    def resolve(self, lora) -> tuple[float, ...]:
        """A request's ``lora``, checked, as one scale per adapter (llama-server's
        construct_lora_list: an adapter not named gets 0; a later entry for the same id wins).

        ``lora``: ``[{"id": 0, "scale": 0.5}, ...]`` (a missing scale is 0, as there), or a
        mapping {id: scale}. An id that names no adapter is a ValueError (llama-server skips it).
        An empty list turns every adapter off, as llama-server documents (its pinned code
        treats ``[]`` as no field: llama.cpp issue #28674)."""
        scales = [0.0] * len(self.adapters)
        for i, scale in self._entries(lora):
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.adapters):
                have = f"ids 0 to {len(self.adapters) - 1}" if self.adapters else "none (start it with --lora FILE)"
                raise ValueError(f"lora: no adapter has id {i!r}; the loaded adapters have {have}")
            scales[i] = _scale(scale, f"lora: the scale of adapter {i}")
        return tuple(scales)

    @staticmethod
    def _entries(lora) -> Iterable[tuple[Any, Any]]:
        if isinstance(lora, Mapping):
            return list(lora.items())
        if not isinstance(lora, (list, tuple)):
            raise ValueError(f"lora must be a list of {{'id': ..., 'scale': ...}} objects, got {type(lora).__name__}")
        out = []
        for entry in lora:
            if not isinstance(entry, Mapping) or "id" not in entry:
                raise ValueError(f"lora entries are objects with an 'id' and a 'scale', got {str(entry)[:80]}")
            out.append((entry["id"], 0.0 if entry.get("scale") is None else entry["scale"]))
        return out

    # ------------------------------------------------------------------ the engine's side
    def scales_for(self, requested: tuple[float, ...] | None) -> tuple[float, ...]:
        """The scales a request runs with: its own, else the global ones when it starts."""
        return self.scales if requested is None else requested

    def use(self, seq: "Slot", scales: tuple[float, ...]) -> None:
        """Before a generation with ``scales`` on ``seq``: its cached prompt was decoded under
        the adapters at other scales, so it cannot be reused: forget it (llama-server clears
        the slot's prompt in launch_slot_with_task; see the module docstring)."""
        if not self.adapters:
            return
        if self._cached.get(seq.seq_id, self._initial) != scales:
            seq.reset()
            self._cached[seq.seq_id] = scales

    def cached_scales(self, seq_id: int) -> tuple[float, ...]:
        """The scales sequence ``seq_id``'s cached prompt was decoded with (a slot save records them)."""
        return self._cached.get(seq_id, self._initial)

    def mark_cached(self, seq_id: int, scales: tuple[float, ...]) -> None:
        """Sequence ``seq_id`` now holds a prompt decoded with ``scales`` (a slot restore): a later
        request with other scales will not reuse it."""
        if len(scales) != len(self.adapters):
            raise ValueError(f"{len(scales)} LoRA scales for {len(self.adapters)} adapters")
        self._cached[seq_id] = tuple(scales)

    def apply(self, ctx: "Context", scales: tuple[float, ...]) -> None:
        """Decode on ``ctx`` with ``scales`` from now on (free when they are the ones in use)."""
        if self.adapters:
            ctx.set_lora(self.adapters, scales)
