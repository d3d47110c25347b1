"""llama-server's slot routes: ``GET /slots`` (what each slot runs or ran last, and, as this
project's extension ``pyllama_spec``, its cache and speculative state) and
``POST /slots/{id_slot}?action=save|restore|erase`` (a slot's cache to a file under
``--slot-save-path`` and back; the file format is serving/slot_file.py).

A slot action runs on the thread that owns the slot's sequence, once the slot is idle (the
worker's ``on_slot``): an action on a busy slot waits for its generation to end, as llama-server
defers it. Files are read, checked and written on a thread of their own, never on the event loop
nor on the engine's thread.
"""

from __future__ import annotations

import re
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pyllama_spec.errors import ClosedError, KVMemoryError
from pyllama_spec.server.errors import APIError, bad_request
from pyllama_spec.server.llama_fields import generation_params
from pyllama_spec.server.offload import off_loop
from pyllama_spec.server.service import RouteSpec, Service, read_json
from pyllama_spec.serving import slot_file

#: Characters llama-server's fs_validate_filename refuses in a file name, beyond control characters.
_FORBIDDEN = set(':*?"<>|/\\') | {"\uff0e", "\u2215", "\u2216", "\ufffd", "\ufeff"}


def valid_filename(name: str) -> bool:
    """Whether llama-server (common's fs_validate_filename, no subdirectories) takes ``name`` as a
    file name under --slot-save-path: 1 to 255 UTF-8 bytes, no control characters, path
    separators, ``:*?"<>|`` or their look-alikes, no surrogates, no leading or trailing space, no
    trailing dot, no "..": so never a path that leaves the folder."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate (JSON's "\\ud800")
        return False
    if not 0 < size <= 255:
        return False
    for c in name:
        o = ord(c)
        if o <= 0x1F or o == 0x7F or 0x80 <= o <= 0x9F or c in _FORBIDDEN:
            return False
    return not (name[0] == " " or name[-1] in " ." or ".." in name)


def routes(service: Service) -> list[RouteSpec]:
    files = _SlotFiles(service)
    return [
        ("/slots", ["GET"], lambda r: _get_slots(service, r)),
        ("/slots/{id_slot}", ["POST"], lambda r: _post_slot(service, files, r)),
    ]


# ----------------------------------------------------------------------------- GET /slots


async def _get_slots(service: Service, request: Request) -> Response:
    if not service.settings.endpoint_slots:
        raise APIError(501, "This server does not support slots endpoint. Start it with `--slots`",
                       type="not_supported_error", code="not_supported")
    states = service.worker.slot_jobs()
    if request.query_params.get("fail_on_no_slot") and all(busy for busy, _, _ in states):
        raise APIError(503, "no slot available", type="unavailable_error", code="unavailable")
    return JSONResponse([slot_json(service, i, *state) for i, state in enumerate(states)])


def slot_json(service: Service, i: int, processing: bool, job, stats) -> dict:
    """One slot as llama-server's /slots shows it (without its LLAMA_SERVER_SLOTS_DEBUG fields),
    plus the ``pyllama_spec`` extension: the slot's cache and its speculative settings and
    acceptance. Plain Python reads: no native call (the engine's thread may be generating)."""
    engine = service.engine
    seq = engine.sequences[i]
    out = {"id": i, "n_ctx": seq.n_ctx, "speculative": engine.drafter is not None, "is_processing": processing}
    r = job.request if job is not None else None
    if job is not None:
        out.update(
            id_task=job.id_task,
            n_prompt_tokens=seq.positions.n_rows,  # what the slot's cache holds, as llama-server counts it
            n_prompt_tokens_processed=stats.prompt_decoded if stats is not None else 0,
            n_prompt_tokens_cache=stats.prompt_reused if stats is not None else 0,
            params=generation_params(service, r, job.stream),
            # an idle slot's next-token budget reads as llama-server's (-1 left, 0 decoded): a finished
            # task's counts do not leak into it (its prompt counts above stay, for what the slot holds)
            next_token=[{"has_next_token": processing, "has_new_line": job.has_new_line,
                         "n_remain": max(0, r.output.max_tokens - job.n_decoded) if processing else -1,
                         "n_decoded": job.n_decoded if processing else 0}])
    p, d, cfg = seq.positions, engine.drafter, engine.config
    out["pyllama_spec"] = {
        "cache": {"n_rows": p.n_rows, "pos_next": p.pos_next, "draft_pos_next": p.draft_pos_next,
                  "draft_positions": p.draft_positions},
        "draft": {"type": cfg.spec_type, "n_max": r.draft.n_max if r else engine.draft_max,
                  "n_min": r.draft.n_min if r else d.n_min if d else 0, "verify": r.draft.verify if r else cfg.verify,
                  "draft_positions": r.draft.positions if r else cfg.draft_positions,
                  "tree": r.draft.tree if r else cfg.draft_tree},
        "acceptance": None if stats is None else {
            "drafted": stats.drafted, "accepted": stats.accepted, "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_length": stats.mean_accepted_length, "target_steps": stats.target_steps,
            "per_position_acceptance": list(stats.per_position_acceptance)},
    }
    return out


# ----------------------------------------------------------------------------- POST /slots/{id_slot}


class _SlotFiles:
    """The save folder and this engine's identity in slot files (read once, off the event loop)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self._identity: slot_file.SlotIdentity | None = None
        self._bound: int | None = None

    async def identity(self) -> slot_file.SlotIdentity:
        if self._identity is None:
            c = self.service.engine.config
            self._identity = await off_loop(
                True, lambda: slot_file.identity(c.model, c.mmproj, type_k=c.cache_type_k, type_v=c.cache_type_v,
                                                 lora_paths=[a.path for a in self.service.engine.lora.adapters]))
        return self._identity

    async def memory_bound(self, n_ctx: int) -> int:
        """The most memory a slot file of this server may hold (a planted file claiming gigabytes is
        refused before it is read)."""
        if self._bound is None:
            c = self.service.engine.config
            self._bound = await off_loop(True, lambda: slot_file.memory_bound(
                c.model, n_ctx=n_ctx, type_k=c.cache_type_k, type_v=c.cache_type_v))
        return self._bound


async def _post_slot(service: Service, files: _SlotFiles, request: Request) -> Response:
    """llama-server's checks, in its order: the folder, the slot id, the action, the file name,
    then the slot itself."""
    folder = service.settings.slot_save_path
    if folder is None:
        raise APIError(501, "This server does not support slots action. Start it with `--slot-save-path`",
                       type="not_supported_error", code="not_supported")
    raw_id = request.path_params["id_slot"]
    if not re.fullmatch(r"-?[0-9]{1,9}", raw_id):
        raise bad_request("Invalid slot ID", "id_slot")
    id_slot = int(raw_id)
    action = request.query_params.get("action", "")
    if action not in ("save", "restore", "erase"):
        raise bad_request("Invalid action", "action")
    filename = None
    if action != "erase":
        body, _ = await read_json(request, service.settings.max_body_bytes, service.settings.body_timeout)
        filename = body.get("filename") if isinstance(body, dict) else None
        if not isinstance(filename, str):
            raise bad_request("'filename' must be a string: the file's name under --slot-save-path", "filename")
        if not valid_filename(filename):
            raise bad_request("Invalid filename", "filename")
    # llama-server wraps an id past the last slot around; an id that names no slot is a 400 here
    if not 0 <= id_slot < service.engine.config.n_parallel:
        raise bad_request("Invalid slot ID", "id_slot")
    if action == "erase":
        return JSONResponse({"id_slot": id_slot, "n_erased": await _on_slot(service, id_slot, _erase)})
    path = folder / filename
    if action == "save":
        return JSONResponse(await _save(service, files, id_slot, filename, path))
    return JSONResponse(await _restore(service, files, id_slot, filename, path))


async def _on_slot(service: Service, slot: int, fn):
    """``fn(sequence)`` run by the worker once the slot is idle."""
    try:
        return await service.worker.on_slot(slot, fn)
    except ClosedError as e:
        raise APIError(503, str(e), type="server_error", code="cancelled") from None


def _erase(seq) -> int:
    n = seq.positions.n_rows
    seq.reset()
    return n


def _timed(fn):
    def run(seq):
        t = time.perf_counter()
        out = fn(seq)
        return out, time.perf_counter() - t
    return run


async def _save(service: Service, files: _SlotFiles, id_slot: int, filename: str, path) -> dict:
    lora = service.engine.lora
    (saved, scales), seconds = await _on_slot(
        service, id_slot, _timed(lambda seq: (seq.save_state(), lora.cached_scales(seq.seq_id))))
    ident = await files.identity()
    t = time.perf_counter()
    try:
        n_written = await off_loop(True, slot_file.write, path, saved, ident, scales)
    except OSError as e:
        raise APIError(500, f"Unable to save slot: {e.strerror or e}", type="server_error",
                       code="save_failed") from None
    seconds += time.perf_counter() - t
    return {"id_slot": id_slot, "filename": filename, "n_saved": saved.positions().n_rows, "n_written": n_written,
            "timings": {"save_ms": seconds * 1000}}


async def _restore(service: Service, files: _SlotFiles, id_slot: int, filename: str, path) -> dict:
    ident = await files.identity()
    seq = service.engine.sequences[id_slot]
    bound = await files.memory_bound(seq.n_ctx)  # every slot has the same n_ctx
    t = time.perf_counter()
    try:
        saved, n_read, scales = await off_loop(
            True, lambda: slot_file.read(path, ident, n_ctx=seq.n_ctx, n_vocab=service.facts["n_vocab"],
                                         max_memory=bound))
    except FileNotFoundError:
        raise bad_request("Unable to restore slot: no such file under --slot-save-path", "filename") from None
    except (slot_file.SlotFileError, OSError) as e:
        reason = e.strerror if isinstance(e, OSError) and not isinstance(e, slot_file.SlotFileError) else str(e)
        raise bad_request(f"Unable to restore slot: {reason}", "filename") from None
    seconds = time.perf_counter() - t
    try:
        def restore(seq):
            seq.restore_state(saved)
            service.engine.lora.mark_cached(seq.seq_id, scales)  # a request with other scales starts afresh

        _, restoring = await _on_slot(service, id_slot, _timed(restore))
    except KVMemoryError as e:  # the target refused it (the slot is left empty)
        raise bad_request(f"Unable to restore slot: {e}", "filename") from None
    return {"id_slot": id_slot, "filename": filename, "n_restored": saved.positions().n_rows, "n_read": n_read,
            "timings": {"restore_ms": (seconds + restoring) * 1000}}
