"""llama-server's slot routes in `pyllama-spec serve`: GET /slots, POST /slots/{id}?action=
save|restore|erase under --slot-save-path, the id_slot request field, GET/POST /props and
GET /v1/models; with one slot and with -np 2 (the engine's slot loop, either way).

A slot saved, erased and restored gives the next request that shares its prefix the cached rows
(cached_tokens) and the same greedy output as a fresh server, images included; a file that is
not this model's, or is damaged, is a 400 and the slot goes on working. The shapes are compared
with the pinned llama-server's on the same tiny target where it is built.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_ENGINE, load_tiny, needs_llama_server

import pyllama_spec as ps
from pyllama_spec.devtools import tiny
from pyllama_spec.errors import KVMemoryError

httpx = pytest.importorskip("httpx", reason="the test extra brings httpx")
pytest.importorskip("uvicorn", reason="the server extra brings uvicorn")
from serving import LocalServer  # noqa: E402

from pyllama_spec.server import ServerSettings  # noqa: E402
from pyllama_spec.server.slots import valid_filename  # noqa: E402
from pyllama_spec.serving import slot_file  # noqa: E402

N_CTX_SLOT = 1024
PROMPT = "def add(a, b):"


def _engine(models, n_parallel: int, **kw):
    return load_tiny(models, n_ctx=N_CTX_SLOT * n_parallel, flash_attn=False, n_parallel=n_parallel, **kw)


class _Served:
    """A LocalServer on its own engine, with a save folder, and an httpx client for it."""

    def __init__(self, models, n_parallel: int, save_dir: Path | None, **settings) -> None:
        self.engine = _engine(models, n_parallel)
        self.server = LocalServer(self.engine, ServerSettings(alias="tiny", slot_save_path=save_dir, **settings))
        self.http = httpx.Client(base_url=self.server.url, timeout=120)
        self.save_dir = save_dir

    def post(self, path: str, body=None) -> httpx.Response:
        if body is None:
            return self.http.post(path)
        # json.dumps escapes every non-ASCII character, so a lone surrogate ("\ud800") goes as JSON has it
        return self.http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})

    def close(self) -> None:
        self.http.close()
        self.server.stop()
        self.engine.close()


@pytest.fixture(scope="module", params=[1, 2], ids=["one-slot", "two-slots"])
def served(request, tiny_dense, tmp_path_factory):
    s = _Served(tiny_dense, request.param, tmp_path_factory.mktemp("slots"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def fresh(tiny_dense):
    """Answers of a server that never saw a slot file (one slot, its cache erased before each)."""
    s = _Served(tiny_dense, 1, None)
    cache = {}

    def answer(path: str, body: dict) -> dict:
        key = json.dumps([path, body], sort_keys=True)
        if key not in cache:
            s.engine.reset_cache()
            r = s.post(path, body)
            assert r.status_code == 200, r.text
            cache[key] = r.json()
        return cache[key]

    yield answer
    s.close()


def _png(seed: int, side: int = 224) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((side, side, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _image_turn(png: bytes, text: str) -> dict:
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                        {"type": "text", "text": text}]}


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


# ----------------------------------------------------------------------------- save, erase, restore


def test_save_erase_restore_gives_the_next_request_the_prefix_and_the_same_greedy_output(served, fresh):
    body = {"prompt": PROMPT + "\n    return", "n_predict": 12, "temperature": 0}
    first = _ok(served.post("/completion", {**body, "id_slot": 0}))
    assert first["id_slot"] == 0
    saved = _ok(served.post("/slots/0?action=save", {"filename": "add.bin"}))
    assert set(saved) == {"id_slot", "filename", "n_saved", "n_written", "timings"}
    assert (saved["id_slot"], saved["filename"]) == (0, "add.bin") and set(saved["timings"]) == {"save_ms"}
    assert saved["n_saved"] == _ok(served.http.get("/slots"))[0]["n_prompt_tokens"] >= first["tokens_evaluated"]
    assert saved["n_written"] == (served.save_dir / "add.bin").stat().st_size
    assert _ok(served.post("/slots/0?action=erase")) == {"id_slot": 0, "n_erased": saved["n_saved"]}
    assert _ok(served.post("/completion", {**body, "id_slot": 0}))["timings"]["cache_n"] == 0  # erased: none reused
    _ok(served.post("/slots/0?action=erase"))

    restored = _ok(served.post("/slots/0?action=restore", {"filename": "add.bin"}))
    assert set(restored) == {"id_slot", "filename", "n_restored", "n_read", "timings"}
    assert (restored["n_restored"], restored["n_read"]) == (saved["n_saved"], saved["n_written"])
    # a longer prompt over the restored one: all of it is reused, and the answer is a fresh server's
    longer = {**body, "prompt": body["prompt"] + first["content"] + "\n\ndef sub(a, b):"}
    again = _ok(served.post("/completion", {**longer, "id_slot": 0}))
    assert again["timings"]["cache_n"] >= first["tokens_evaluated"]  # the prompt rows reused
    reference = fresh("/completion", longer)
    assert (again["content"], again["tokens_predicted"]) == (reference["content"], reference["tokens_predicted"])
    assert reference["timings"]["cache_n"] == 0


def test_a_restored_image_prefix_is_reused_and_what_follows_it_is_a_fresh_servers_answer(served, fresh):
    png = _png(3)
    turn = {"messages": [_image_turn(png, "what is this?")], "max_tokens": 8, "temperature": 0}
    first = _ok(served.post("/v1/chat/completions", {**turn, "id_slot": 0}))
    _ok(served.post("/slots/0?action=save", {"filename": "image.bin"}))
    _ok(served.post("/slots/0?action=erase"))
    _ok(served.post("/slots/0?action=restore", {"filename": "image.bin"}))
    follow = {**turn, "messages": [*turn["messages"], {"role": "assistant", "content": first["choices"][0]["message"]
                                                       ["content"]}, {"role": "user", "content": "and then?"}]}
    again = _ok(served.post("/v1/chat/completions", {**follow, "id_slot": 0}))
    # the whole first turn, its image rows included, came from the restored file
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
    reference = fresh("/v1/chat/completions", follow)
    assert again["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]


@pytest.mark.parametrize("name", ["../x", "/tmp/x", "", "a/b", "a\\b", "..", ".", "x.", " x", "x ", "a:b", "a*b",
                                  "a?b", 'a"b', "a<b", "a>b", "a|b", "a\x01b", "a\u2215b", "a\uff0eb", "a" * 256,
                                  "\ud800"])
def test_a_file_name_llama_server_refuses_is_a_400_and_nothing_is_written(served, name):
    r = served.post("/slots/0?action=save", {"filename": name})
    assert r.status_code == 400 and r.json()["error"]["message"] == "Invalid filename"
    assert served.post("/slots/0?action=restore", {"filename": name}).status_code == 400
    assert not [p for p in served.save_dir.parent.iterdir() if p.name in ("x", "b")]  # nothing beside the folder


def test_file_names_llama_server_takes_are_taken():
    for name in ("slot.bin", ".hidden", "a b", "é.bin", "x" * 255, "a.b.c"):
        assert valid_filename(name), name


def test_a_damaged_file_is_a_400_and_the_slot_works_on(served, fresh):
    body = {"prompt": "class Stack:", "n_predict": 6, "temperature": 0}
    _ok(served.post("/completion", {**body, "id_slot": 0}))
    _ok(served.post("/slots/0?action=save", {"filename": "good.bin"}))
    good = (served.save_dir / "good.bin").read_bytes()
    damaged = {
        "truncated.bin": good[:-10],
        "flipped.bin": good[:-5] + bytes([good[-5] ^ 0xFF]) + good[-4:],
        "garbage.bin": b"\x00" * 64,
        "empty.bin": b"",
        "header.bin": good[:8] + (10**9).to_bytes(4, "little") + good[12:],
    }
    for name, data in damaged.items():
        (served.save_dir / name).write_bytes(data)
        r = served.post("/slots/0?action=restore", {"filename": name})
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["message"].startswith("Unable to restore slot: "), r.text
    missing = served.post("/slots/0?action=restore", {"filename": "missing.bin"})
    assert missing.status_code == 400 and "no such file" in missing.json()["error"]["message"]
    after = _ok(served.post("/completion", {**body, "id_slot": 0}))
    assert after["content"] == fresh("/completion", body)["content"]


def test_a_fifo_or_a_link_in_the_slot_folder_is_a_400_at_once(served, fresh):
    """Not a regular file: refused without reading (a FIFO used to hold the reading thread until
    something wrote to it; a link could point anywhere)."""
    import os
    import time

    body = {"prompt": "class Stack:", "n_predict": 6, "temperature": 0}
    _ok(served.post("/completion", {**body, "id_slot": 0}))
    _ok(served.post("/slots/0?action=save", {"filename": "real.bin"}))
    fifo, link = served.save_dir / "fifo.bin", served.save_dir / "link.bin"
    for p in (fifo, link):
        if p.is_symlink() or p.exists():
            p.unlink()
    os.mkfifo(fifo)
    link.symlink_to(served.save_dir / "real.bin")
    for name, why in (("fifo.bin", "not a regular file"), ("link.bin", "symbolic link")):
        t0 = time.perf_counter()
        r = served.post("/slots/0?action=restore", {"filename": name})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
        assert time.perf_counter() - t0 < 10
    after = _ok(served.post("/completion", {**body, "id_slot": 0}))
    assert after["content"] == fresh("/completion", body)["content"]


def test_a_file_claiming_more_memory_than_a_slot_holds_is_refused_before_it_is_read(served, fresh):
    """Issue 43, item 7: a well-formed file whose header claims 2 GiB of memory (a sparse file, the size
    matching) was read whole, +2 GB of RSS; the claim is now compared with what a slot of this model
    can hold first."""
    import json as _json
    import struct
    import time

    _ok(served.post("/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "id_slot": 0}))
    _ok(served.post("/slots/0?action=save", {"filename": "big.bin"}))
    path = served.save_dir / "big.bin"
    raw = path.read_bytes()
    n_header = struct.unpack("<I", raw[8:12])[0]
    header = _json.loads(raw[12:12 + n_header])
    header["memory"]["size"] = claimed = 2 * 2**30
    head = _json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(raw[:8] + struct.pack("<I", len(head)) + head)
        f.truncate(12 + len(head) + claimed)  # sparse: no disk, but reading it would take 2 GiB
    t0 = time.perf_counter()
    r = served.post("/slots/0?action=restore", {"filename": "big.bin"})
    assert r.status_code == 400 and f"claims {claimed} bytes" in r.json()["error"]["message"], r.text
    assert time.perf_counter() - t0 < 5
    path.unlink()
    body = {"prompt": "import os", "n_predict": 6, "temperature": 0}
    assert _ok(served.post("/completion", {**body, "id_slot": 0}))["content"] == fresh("/completion", body)["content"]


def test_a_file_saved_from_another_model_is_a_400_and_the_slot_works_on(served, fresh, tiny_dir):
    other = tiny.make_tiny_set(tiny_dir, arch="hunyuan_vl", seed=1, window=32, predictable=0.5)  # the same shapes
    engine = ps.load(other.target, n_ctx=N_CTX_SLOT, **TINY_ENGINE, flash_attn=False)
    try:
        engine.generate(PROMPT, max_tokens=4)
        saved = engine.run_on_slot(0, lambda seq: seq.save_state()).result()
        c = engine.config
        slot_file.write(served.save_dir / "other.bin", saved,
                        slot_file.identity(c.model, None, type_k=c.cache_type_k, type_v=c.cache_type_v))
    finally:
        engine.close()
    r = served.post("/slots/0?action=restore", {"filename": "other.bin"})
    assert r.status_code == 400 and "another model" in r.json()["error"]["message"], r.text
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0}
    assert _ok(served.post("/completion", {**body, "id_slot": 0}))["content"] == fresh("/completion", body)["content"]


def test_a_restore_the_target_refuses_leaves_the_slot_empty_and_usable(served, fresh):
    """A file whose header passes but whose memory llama.cpp cannot read (rewritten with a valid
    checksum): the target refuses it, the slot is emptied, and it serves the next request."""
    _ok(served.post("/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "id_slot": 0}))
    _ok(served.post("/slots/0?action=save", {"filename": "native.bin"}))
    c = served.engine.config
    identity = slot_file.identity(c.model, c.mmproj, type_k=c.cache_type_k, type_v=c.cache_type_v)
    saved, _, scales = slot_file.read(served.save_dir / "native.bin", identity, n_ctx=N_CTX_SLOT,
                              n_vocab=served.engine.model.n_vocab)
    bad = type(saved)(saved.parts, saved.draft_positions, b"\x00" * len(saved.memory))
    slot_file.write(served.save_dir / "native.bin", bad, identity, scales)
    r = served.post("/slots/0?action=restore", {"filename": "native.bin"})
    assert r.status_code == 400 and "llama_state_seq_set_data" in r.json()["error"]["message"], r.text
    assert _ok(served.http.get("/slots"))[0]["pyllama_spec"]["cache"]["n_rows"] == 0
    body = {"prompt": "import os", "n_predict": 6, "temperature": 0}
    assert _ok(served.post("/completion", {**body, "id_slot": 0}))["content"] == fresh("/completion", body)["content"]


def test_a_cache_restored_into_another_slot_goes_on_exactly_as_the_one_it_was_saved_from(tiny_dense):
    engine = _engine(tiny_dense, 2)
    try:
        first = engine.submit(PROMPT, max_tokens=6, id_slot=0).result()
        saved = engine.run_on_slot(0, lambda seq: seq.save_state()).result()
        engine.run_on_slot(1, lambda seq: seq.restore_state(saved)).result()
        go_on = PROMPT + first.text + "\n    return a"
        a, b = (engine.submit(go_on, max_tokens=8, id_slot=slot).result() for slot in (0, 1))
        assert a.tokens == b.tokens and a.stats.prompt_reused == b.stats.prompt_reused >= first.stats.prompt_tokens
        garbage = dataclasses.replace(saved, memory=b"\0" * 64)
        with pytest.raises(KVMemoryError, match="llama_state_seq_set_data"):
            engine.run_on_slot(1, lambda seq: seq.restore_state(garbage)).result()
        assert engine.run_on_slot(1, lambda seq: (seq.positions.n_rows, seq.cached)).result() == (0, [])
    finally:
        engine.close()


# ----------------------------------------------------------------------------- /slots and id_slot


def test_slots_lists_each_slot_with_its_request_and_speculative_state(served):
    n = served.engine.config.n_parallel
    done = _ok(served.post("/completion", {"prompt": PROMPT, "n_predict": 5, "temperature": 0, "top_k": 7,
                                           "ignore_eos": True, "id_slot": n - 1, "speculative.n_max": 3}))
    assert done["id_slot"] == n - 1
    slots = _ok(served.http.get("/slots"))
    assert [s["id"] for s in slots] == list(range(n))
    s = slots[n - 1]
    assert (s["n_ctx"], s["speculative"], s["is_processing"]) == (N_CTX_SLOT, True, False)
    assert s["params"]["top_k"] == 7 and s["params"]["n_predict"] == 5 and s["params"]["temperature"] == 0
    assert s["params"]["speculative.types"] == "draft-dflash" and s["params"]["ignore_eos"] is True
    # an idle slot's budget is reset, as llama-server's (its test_metrics_slots_idle_after_completion)
    assert s["next_token"] == [{"has_next_token": False, "has_new_line": "\n" in done["content"], "n_remain": -1,
                                "n_decoded": 0}]
    assert s["n_prompt_tokens"] >= done["tokens_evaluated"] + done["tokens_predicted"] - 1
    assert s["n_prompt_tokens_processed"] + s["n_prompt_tokens_cache"] == done["tokens_evaluated"]
    ext = s["pyllama_spec"]
    assert ext["draft"]["n_max"] == 3 and ext["draft"]["type"] == "draft-dflash"
    assert ext["acceptance"]["drafted"] == done["timings"]["draft_n"]
    assert ext["acceptance"]["accepted"] == done["timings"]["draft_n_accepted"]
    assert ext["cache"]["n_rows"] == s["n_prompt_tokens"]


@pytest.mark.parametrize("value", [-2, 2, "0", 1.0, True])
def test_an_id_slot_that_names_no_slot_is_a_400(served, value):
    n = served.engine.config.n_parallel
    value = n if value == 2 else value
    r = served.post("/completion", {"prompt": PROMPT, "n_predict": 1, "id_slot": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "id_slot", r.text
    assert served.post("/slots/9?action=erase").status_code == 400
    assert served.post("/slots/x?action=erase").json()["error"]["message"] == "Invalid slot ID"
    assert served.post("/slots/0?action=nap").json()["error"]["message"] == "Invalid action"


def test_requests_run_in_the_slot_they_name(tiny_dense):
    s = _Served(tiny_dense, 2, None)
    try:
        for slot in (1, 0, 1):
            body = {"prompt": f"x = {slot}", "n_predict": 2, "temperature": 0, "id_slot": slot}
            assert _ok(s.post("/completion", body))["id_slot"] == slot
            events = [json.loads(line[5:]) for line in s.post("/completion", {**body, "stream": True}).text.splitlines()
                      if line.startswith("data:")]
            assert {e["id_slot"] for e in events} == {slot}
        assert _ok(s.http.get("/slots"))[1]["id_task"] == 5  # the sixth request
    finally:
        s.close()


def _stream_in_background(s: _Served, slot: int, n: int) -> tuple[threading.Thread, dict]:
    """A long greedy generation on ``slot``, read to its end on a thread (``out['ended']``: when),
    its steps slowed down so that it runs for seconds."""
    out: dict = {}
    _slow_steps(s.engine, 0.005)

    def run():
        body = {"prompt": PROMPT, "n_predict": n, "ignore_eos": True, "temperature": 0, "id_slot": slot,
                "stream": True}
        with s.http.stream("POST", "/completion", json=body) as r:
            for _ in r.iter_lines():
                pass
        out["ended"] = time.monotonic()

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while not s.http.get("/slots").json()[slot]["is_processing"]:
        assert time.monotonic() < deadline and t.is_alive(), "the generation never showed in /slots"
        time.sleep(0.005)
    return t, out


def _slow_steps(engine, seconds: float) -> None:
    """Make each speculative step of ``engine`` take ``seconds`` longer (its draft call sleeps), so
    that a generation of a few hundred tokens runs for seconds."""
    draft = engine.drafter.draft

    def slow_draft(requests):
        time.sleep(seconds)
        return draft(requests)

    engine.drafter.draft = slow_draft


def test_a_request_for_a_busy_slot_waits_for_it_while_the_others_take_the_free_slots(tiny_dense):
    engine = _engine(tiny_dense, 2)
    _slow_steps(engine, 0.002)
    try:
        long = engine.submit(PROMPT, max_tokens=400, ignore_eos=True, id_slot=0)
        pinned = engine.submit("x = 1", max_tokens=2, id_slot=0)
        free = engine.submit("y = 2", max_tokens=2)
        free.result()
        assert free.slot == 1 and not long.finished.is_set() and pinned.slot is None  # still waiting for slot 0
        pinned.result()
        assert pinned.slot == 0 and long.finished.is_set()
        with pytest.raises(ValueError, match="id_slot"):
            engine.submit(PROMPT, id_slot=2)
    finally:
        engine.close()


@pytest.mark.parametrize("n_parallel", [1, 2])
def test_an_action_on_a_busy_slot_waits_for_its_generation_and_a_full_house_fails_on_no_slot(tiny_dense, tmp_path,
                                                                                             n_parallel):
    s = _Served(tiny_dense, n_parallel, tmp_path)
    try:
        t, out = _stream_in_background(s, 0, 900)
        if n_parallel == 1:  # every slot busy
            r = s.http.get("/slots?fail_on_no_slot=1")
            assert r.status_code == 503 and r.json()["error"] == {"message": "no slot available",
                                                                   "type": "unavailable_error", "code": "unavailable",
                                                                   "param": None}
        else:  # the other slot is free: answered at once, while slot 0 still generates
            assert s.http.get("/slots?fail_on_no_slot=1").status_code == 200
            assert _ok(s.post("/slots/1?action=save", {"filename": "idle.bin"}))["n_saved"] == 0
            assert "ended" not in out and s.http.get("/slots").json()[0]["is_processing"]
        saved = _ok(s.post("/slots/0?action=save", {"filename": "busy.bin"}))
        t.join(60)
        # saved once the generation ended: its cache holds the prompt and the 900 tokens
        assert saved["n_saved"] == _ok(s.http.get("/slots"))[0]["n_prompt_tokens"] > 900
        assert s.http.get("/slots?fail_on_no_slot=1").status_code == 200
    finally:
        s.close()


# ----------------------------------------------------------------------------- switches, /props, /v1/models


def test_without_the_switches_the_routes_answer_as_llama_server_does(tiny_dense):
    s = _Served(tiny_dense, 1, None, endpoint_slots=False)
    try:
        r = s.http.get("/slots")
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
        assert "--slots" in r.json()["error"]["message"]
        for action in ("save", "restore", "erase"):
            r = s.post(f"/slots/0?action={action}", {"filename": "a.bin"})
            assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]
        r = s.post("/props", {})
        assert r.status_code == 501 and "--props" in r.json()["error"]["message"]
        assert _ok(s.http.get("/props"))["endpoint_slots"] is False
    finally:
        s.close()


def test_post_props_with_props_changes_nothing_and_says_so(tiny_dense):
    s = _Served(tiny_dense, 1, None, endpoint_props=True)
    try:
        assert _ok(s.post("/props", {})) == {"success": True}
        assert _ok(s.http.post("/props")) == {"success": True}
        r = s.post("/props", {"n_ctx": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n_ctx"
        assert s.post("/props", [1]).status_code == 400
        assert _ok(s.http.get("/props"))["endpoint_props"] is True
    finally:
        s.close()


def test_props_reports_a_slots_context_and_the_default_settings(served):
    props = _ok(served.http.get("/props"))
    dgs = props["default_generation_settings"]
    assert dgs["n_ctx"] == N_CTX_SLOT and props["total_slots"] == served.engine.config.n_parallel
    assert dgs["params"]["temperature"] == 0 and dgs["params"]["n_predict"] == dgs["max_tokens"]
    assert dgs["speculative"]["type"] == "draft-dflash"  # this project's extension, kept
    assert props["modalities"] == {"vision": True, "video": False, "audio": False}
    assert props["eos_token"] == "<|im_end|>"
    models = _ok(served.http.get("/v1/models"))
    assert models["data"][0]["meta"]["n_ctx"] == N_CTX_SLOT
    assert models["models"][0]["name"] == models["data"][0]["id"] == "tiny"
    assert models["models"][0]["capabilities"] == ["completion", "multimodal"]


def test_serve_honours_the_slot_flags(tmp_path, monkeypatch):
    from pyllama_spec.cli import options
    from pyllama_spec.cli.serve import serve

    with options.err_console.capture() as captured:
        ctx = serve.make_context("serve", ["--no-slots", "--slot-save-path", str(tmp_path), "--props"])
    assert (ctx.params["endpoint_slots"], ctx.params["slot_save_path"], ctx.params["endpoint_props"]) == \
        (False, str(tmp_path), True)
    assert "ignored" not in captured.get()
    assert serve.make_context("serve", []).params["endpoint_slots"] is True  # llama-server's default: served
    monkeypatch.setenv("LLAMA_ARG_ENDPOINT_SLOTS", "0")  # llama-server's variables set them too
    monkeypatch.setenv("LLAMA_ARG_ENDPOINT_PROPS", "1")
    params = serve.make_context("serve", []).params
    assert (params["endpoint_slots"], params["endpoint_props"]) == (False, True)
    import click

    with pytest.raises(click.BadParameter):
        serve.make_context("serve", ["--slot-save-path", str(tmp_path / "missing")])


# ----------------------------------------------------------------------------- against llama-server


@pytest.fixture(scope="module")
def pair(tiny_dense, tmp_path_factory):
    """llama-server and this server, both with -np 2 and a save folder each, on the same target."""
    from test_llama_server_parity import _Process

    theirs_dir, ours_dir = tmp_path_factory.mktemp("theirs"), tmp_path_factory.mktemp("ours")
    theirs = _Process(["-m", str(tiny_dense.target), "--mmproj", str(tiny_dense.mmproj), "-c", str(2 * N_CTX_SLOT),
                       "-np", "2", "--no-warmup", "-t", "1", "--slot-save-path", str(theirs_dir)])
    ours = _Served(tiny_dense, 2, ours_dir)
    yield ours, httpx.Client(base_url=theirs.url, timeout=120)
    ours.close()
    theirs.stop()


@needs_llama_server
def test_slots_has_llama_servers_fields_idle_and_after_a_request(pair):
    ours, theirs = pair
    a, b = _ok(ours.http.get("/slots")), _ok(theirs.get("/slots"))
    assert [set(s) - {"pyllama_spec"} for s in a] == [set(s) for s in b]
    # (no drafts: the cache then holds the prompt and the tokens decoded, as llama-server's does)
    body = {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "id_slot": 1, "speculative.n_max": 0}
    _ok(ours.post("/completion", body)), _ok(theirs.post("/completion", json=body))
    a, b = _ok(ours.http.get("/slots"))[1], _ok(theirs.get("/slots"))[1]
    assert set(a) - {"pyllama_spec"} == set(b)
    # what llama-server reports that does not apply here: its chat parser, adaptive-p sampling, options not served
    not_here = {"chat_format", "reasoning_format", "reasoning_in_content", "generation_prompt", "adaptive_target",
                "adaptive_decay", "timings_per_token", "post_sampling_probs", "backend_sampling"}
    assert set(b["params"]) - set(a["params"]) == not_here
    assert set(a["params"]) <= set(b["params"])
    for key in ("top_k", "top_p", "min_p", "repeat_last_n", "n_predict", "max_tokens", "samplers", "stream", "lora"):
        assert a["params"][key] == pytest.approx(b["params"][key]), key
    assert set(a["next_token"][0]) == set(b["next_token"][0])
    assert a["n_prompt_tokens"] == b["n_prompt_tokens"] and a["n_ctx"] == b["n_ctx"]


@needs_llama_server
@pytest.mark.parametrize("path,body", [
    ("/slots/0?action=save", {"filename": "../x"}),
    ("/slots/0?action=save", {"filename": "/tmp/x"}),
    ("/slots/0?action=save", {"filename": ""}),
    ("/slots/0?action=restore", {"filename": "a/b"}),
    ("/slots/x?action=erase", None),
    ("/slots/0?action=nap", None),
    ("/slots/0", None),
    ("/slots/0?action=restore", {"filename": "never-saved.bin"}),
])
def test_slot_actions_are_refused_with_llama_servers_status(pair, path, body):
    ours, theirs = pair
    a, b = ours.post(path, body), (theirs.post(path, json=body) if body is not None else theirs.post(path))
    assert a.status_code == b.status_code == 400, (a.text, b.text)
    assert a.json()["error"]["type"] == b.json()["error"]["type"]
    if "never-saved" not in path + json.dumps(body):
        assert a.json()["error"]["message"] == b.json()["error"]["message"]
    else:
        assert a.json()["error"]["message"].startswith("Unable to restore slot: ")


@needs_llama_server
def test_save_and_erase_answer_in_llama_servers_shape_and_counts(pair):
    ours, theirs = pair
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "id_slot": 0, "speculative.n_max": 0}
    _ok(ours.post("/completion", body)), _ok(theirs.post("/completion", json=body))
    a = _ok(ours.post("/slots/0?action=save", {"filename": "s.bin"}))
    b = _ok(theirs.post("/slots/0?action=save", json={"filename": "s.bin"}))
    assert set(a) == set(b) and set(a["timings"]) == set(b["timings"])
    assert a["n_saved"] == b["n_saved"]  # the same cache rows: prompt and generated tokens
    ra = _ok(ours.post("/slots/0?action=restore", {"filename": "s.bin"}))
    rb = _ok(theirs.post("/slots/0?action=restore", json={"filename": "s.bin"}))
    assert set(ra) == set(rb) and ra["n_restored"] == rb["n_restored"]
    assert _ok(ours.post("/slots/0?action=erase")) == _ok(theirs.post("/slots/0?action=erase"))
    again = _ok(ours.post("/completion", body)), _ok(theirs.post("/completion", json=body))
    assert again[0]["content"] == again[1]["content"]


@needs_llama_server
def test_props_and_models_have_llama_servers_fields(pair):
    ours, theirs = pair
    a, b = _ok(ours.http.get("/props")), _ok(theirs.get("/props"))
    # not read here: the GGUF's file type, llama-server's web-UI settings
    assert set(b) - set(a) == {"model_ftype", "ui_settings"}
    assert (a["chat_template"], a["chat_template_caps"]) == (b["chat_template"], b["chat_template_caps"])
    assert a["default_generation_settings"]["n_ctx"] == b["default_generation_settings"]["n_ctx"]
    assert set(b["default_generation_settings"]) <= set(a["default_generation_settings"])
    assert (a["bos_token"], a["eos_token"], a["modalities"]) == (b["bos_token"], b["eos_token"], b["modalities"])
    assert (a["total_slots"], a["endpoint_slots"], a["endpoint_props"]) == \
        (b["total_slots"], b["endpoint_slots"], b["endpoint_props"])
    ma, mb = _ok(ours.http.get("/v1/models")), _ok(theirs.get("/v1/models"))
    assert set(ma) == set(mb) and set(ma["models"][0]) == set(mb["models"][0])
    assert set(mb["data"][0]) <= set(ma["data"][0])
    assert set(mb["data"][0]["meta"]) - set(ma["data"][0]["meta"]) == {"vocab_type", "ftype"}
    for key in ("n_vocab", "n_ctx", "n_ctx_train", "n_embd", "n_params", "size"):
        assert ma["data"][0]["meta"][key] == mb["data"][0]["meta"][key], key


def test_a_restored_slot_keeps_the_lora_scales_its_cache_was_decoded_with(tiny_dense, tmp_path):
    """A slot file records the LoRA adapters and scales its cache was decoded through: restored,
    a request at those scales reuses it, one at other scales decodes afresh (its answer is that
    of a fresh server at those scales); a server with other adapters refuses the file."""
    from pyllama_spec.devtools.tiny_lora import write_lora

    adapter = write_lora(tmp_path / "a.gguf", tiny_dense.target, seed=3, strength=2.0)
    save_dir = tmp_path / "saved"
    save_dir.mkdir()
    engine = _engine(tiny_dense, 1, lora=[(str(adapter), 0.5)])
    server = LocalServer(engine, ServerSettings(alias="tiny", slot_save_path=save_dir))
    http = httpx.Client(base_url=server.url, timeout=120)
    try:
        body = {"prompt": PROMPT * 4, "n_predict": 8}
        at_half = http.post("/completion", json=body).json()
        at_one = http.post("/completion", json={**body, "lora": [{"id": 0, "scale": 1.0}]}).json()
        assert at_half["content"] != at_one["content"]  # the scale matters on this adapter
        http.post("/completion", json=body)  # the slot now holds a prompt decoded at 0.5
        assert http.post("/slots/0?action=save", json={"filename": "half.bin"}).status_code == 200
        for scale, expected in ((1.0, at_one), (1.0, at_one), (0.5, at_half)):
            assert http.post("/slots/0?action=erase").status_code == 200
            assert http.post("/slots/0?action=restore", json={"filename": "half.bin"}).status_code == 200
            got = http.post("/completion", json={**body, "lora": [{"id": 0, "scale": scale}]}).json()
            assert got["content"] == expected["content"]
            assert (got["timings"]["cache_n"] > 0) == (scale == 0.5), (scale, got["timings"])
    finally:
        http.close()
        server.stop()
        engine.close()
    plain = _Served(tiny_dense, 1, save_dir)
    try:
        r = plain.post("/slots/0?action=restore", {"filename": "half.bin"})
        assert r.status_code == 400 and "LoRA" in r.json()["error"]["message"]
    finally:
        plain.close()
