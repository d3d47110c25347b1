"""LoRA adapters as llama-server serves them: loaded against the target (--lora, --lora-scaled,
--lora-init-without-apply), global scales (GET/POST /lora-adapters), per-request scales (the
``lora`` field), one slot or several; bad files refused at load, bad requests with a 400.

The adapters are real GGUF LoRA files written for the tiny target (devtools/tiny_lora.py);
the parity tests run the pinned llama-server on the same target and adapters.
"""

from __future__ import annotations

import json
import threading

import pytest
from conftest import N_THREADS, TINY_ENGINE, explain_child, needs_llama_server
from serving import http  # (the test extra brings the server extra it imports)

import pyllama_spec as ps
from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.lora import LoraAdapter
from pyllama_spec.bindings.model import Model
from pyllama_spec.devtools import tiny, tiny_lora
from pyllama_spec.errors import ModelFileError
from pyllama_spec.gguf.writer import GGUFWriter, ValueType

PROMPTS = ("def add(a, b):", "the quick brown fox")
N_PREDICT = 16
KW = dict(n_ctx=1024, **TINY_ENGINE)


@pytest.fixture(scope="module")
def adapters(tiny_dense, tiny_dir):
    """Two adapters of the tiny target: A (seed 0) and B (seed 1, with a task name and prompt prefix)."""
    a = tiny_lora.write_lora(tiny_dir / "lora-a.gguf", tiny_dense.target, seed=0)
    b = tiny_lora.write_lora(tiny_dir / "lora-b.gguf", tiny_dense.target, seed=1, task_name="poems",
                             prompt_prefix="Write a poem: ")
    return a, b


def greedy(target, prompt, *, lora=(), draft=None, **request):
    """The greedy text of one generation on a fresh engine with these adapters."""
    with ps.load(target, draft=draft, lora=lora, **KW) as e:
        return e.generate(prompt, max_tokens=N_PREDICT, **request).text


# --------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("prompt", PROMPTS)
def test_an_adapter_changes_the_targets_greedy_output(tiny_dense, adapters, prompt):
    base = greedy(tiny_dense.target, prompt)
    a, b = (greedy(tiny_dense.target, prompt, lora=[p]) for p in adapters)
    assert a != base and b != base and a != b


def test_scale_zero_is_the_target_alone(tiny_dense, adapters):
    base = greedy(tiny_dense.target, PROMPTS[0])
    assert greedy(tiny_dense.target, PROMPTS[0], lora=[(adapters[0], 0.0)]) == base
    with ps.load(tiny_dense.target, lora=list(adapters), **KW) as e:
        assert e.generate(PROMPTS[0], max_tokens=N_PREDICT, lora=[{"id": 0, "scale": 0}]).text == base
        assert e.generate(PROMPTS[0], max_tokens=N_PREDICT, lora=[]).text == base  # no adapter named: all 0


def test_a_scale_in_between_is_its_own_output_and_requests_override_the_global_scales(tiny_dense, adapters):
    half = greedy(tiny_dense.target, PROMPTS[0], lora=[(adapters[0], 0.5)])
    full = greedy(tiny_dense.target, PROMPTS[0], lora=[adapters[0]])
    assert half != full
    with ps.load(tiny_dense.target, lora=[adapters[0]], **KW) as e:
        assert e.generate(PROMPTS[0], max_tokens=N_PREDICT, lora=[{"id": 0, "scale": 0.5}]).text == half
        assert e.generate(PROMPTS[0], max_tokens=N_PREDICT).text == full


@pytest.mark.parametrize("scales", [None, [{"id": 0, "scale": 0.5}], [{"id": 1, "scale": 1.0}]])
def test_spec_decoding_with_a_dflash_draft_equals_the_adapted_target_alone(tiny_dense, adapters, scales):
    """The adapters go to the target only; the draft proposes, the adapted target decides."""
    for prompt in PROMPTS:
        with ps.load(tiny_dense.target, lora=list(adapters), **KW) as e:
            alone = e.generate(prompt, max_tokens=N_PREDICT, lora=scales).text
        with ps.load(tiny_dense.target, draft=tiny_dense.draft, lora=list(adapters), **KW) as e:
            spec = e.generate(prompt, max_tokens=N_PREDICT, lora=scales)
            assert len(e.ctx.lora) == 2 and e.drafter.ctx.lora == ()  # the target's context only
        assert spec.text == alone
        assert spec.stats.drafted > 0


def test_lora_init_without_apply_starts_at_scale_zero_until_the_scales_are_set(tiny_dense, adapters):
    base = greedy(tiny_dense.target, PROMPTS[0])
    with ps.load(tiny_dense.target, lora=[adapters[0]], lora_init_without_apply=True, **KW) as e:
        assert [a["scale"] for a in e.lora.info()] == [0.0]
        assert e.generate(PROMPTS[0], max_tokens=N_PREDICT).text == base
        e.lora.set_scales([{"id": 0, "scale": 1.0}])
        assert e.generate(PROMPTS[0], max_tokens=N_PREDICT).text == greedy(tiny_dense.target, PROMPTS[0],
                                                                            lora=[adapters[0]])


def test_a_change_of_adapters_forgets_the_cached_prompt_and_the_same_adapters_keep_it(tiny_dense, adapters):
    fresh = greedy(tiny_dense.target, PROMPTS[0], lora=[(adapters[0], 0.5)])
    with ps.load(tiny_dense.target, draft=tiny_dense.draft, lora=[adapters[0]], **KW) as e:
        first = e.generate(PROMPTS[0], max_tokens=N_PREDICT)
        same = e.generate(PROMPTS[0], max_tokens=N_PREDICT)
        assert same.stats.prompt_reused > 0 and same.text == first.text
        changed = e.generate(PROMPTS[0], max_tokens=N_PREDICT, lora=[{"id": 0, "scale": 0.5}])
        assert changed.stats.prompt_reused == 0 and changed.text == fresh
        # new global scales (POST /lora-adapters) count as a change too, for a request without lora
        e.lora.set_scales([{"id": 0, "scale": 0.5}])
        again = e.generate(PROMPTS[0], max_tokens=N_PREDICT)
        assert again.stats.prompt_reused > 0 and again.text == fresh  # decoded under 0.5 just before
        e.lora.set_scales([{"id": 0, "scale": 1.0}])
        back = e.generate(PROMPTS[0], max_tokens=N_PREDICT)
        assert back.stats.prompt_reused == 0 and back.text == first.text


def test_slots_with_different_adapters_each_give_their_own_answer(tiny_dense, adapters):
    """-np 2: requests with different scales never share a target decode (one context, one
    adapter set), so each equals its target-only answer with its own adapters."""
    asks = [None, [{"id": 0, "scale": 0.5}], [{"id": 1, "scale": 1.0}], [], [{"id": 0, "scale": 1.0}]]
    with ps.load(tiny_dense.target, lora=list(adapters), **KW) as e:
        expected = [e.generate(PROMPTS[0], max_tokens=N_PREDICT, lora=s).text for s in asks]
    assert len(set(expected)) >= 3
    with ps.load(tiny_dense.target, draft=tiny_dense.draft, lora=list(adapters), n_parallel=2, **KW) as e:
        subs = [e.submit(PROMPTS[0], max_tokens=N_PREDICT, lora=s) for s in asks]
        assert [s.result().text for s in subs] == expected


def test_bad_request_scales_are_value_errors_before_anything_runs(tiny_dense, adapters):
    with ps.load(tiny_dense.target, lora=[adapters[0]], **KW) as e:
        for bad in ([{"id": 1, "scale": 1}], [{"id": True}], [{"scale": 1}], [{"id": 0, "scale": float("nan")}],
                    [{"id": 0, "scale": "1"}], "0", [[0, 1]]):
            with pytest.raises(ValueError, match="lora"):
                e.generate(PROMPTS[0], max_tokens=1, lora=bad)
    with ps.load(tiny_dense.target, **KW) as e:
        with pytest.raises(ValueError, match="no adapter has id 0"):
            e.generate(PROMPTS[0], max_tokens=1, lora=[{"id": 0, "scale": 1}])


# --------------------------------------------------------------------------- the binding


def test_a_lora_adapter_reads_its_metadata_and_is_freed_before_its_model(tiny_dense, adapters):
    with Model(tiny_dense.target) as model:
        lora = LoraAdapter(model, adapters[1])
        assert (lora.path, lora.task_name, lora.prompt_prefix, lora.alpha) == (str(adapters[1]), "poems",
                                                                              "Write a poem: ", 4.0)
        assert lora.meta("general.type") == "adapter" and lora.meta("no.such.key") is None
        ctx = Context(model, n_ctx=256, **TINY_ENGINE)
        ctx.set_lora([lora], [1.0])
        assert ctx.lora == ((lora, 1.0),)
        lora.close()  # the context lets go of it first: no decode can read freed memory
        assert ctx.lora == () and lora.closed
        lora2 = LoraAdapter(model, adapters[0])
        ctx.set_lora([lora2], [0.5])
    assert lora2.closed and ctx.closed  # the model closed its adapters and contexts


def test_set_lora_refuses_an_adapter_of_another_model_and_bad_scales(tiny_dense, adapters):
    with Model(tiny_dense.target) as m1, Model(tiny_dense.target) as m2:
        lora = LoraAdapter(m1, adapters[0])
        ctx = Context(m2, n_ctx=256, **TINY_ENGINE)
        with pytest.raises(ValueError, match="another model"):
            ctx.set_lora([lora], [1.0])
        ctx1 = Context(m1, n_ctx=256, **TINY_ENGINE)
        for scales in ([float("inf")], [True], [1.0, 2.0]):
            with pytest.raises(ValueError):
                ctx1.set_lora([lora], scales)


# --------------------------------------------------------------------------- bad files


def _write(path, keys: dict, tensors: dict):
    w = GGUFWriter()
    for key, (vtype, value) in keys.items():
        if vtype == ValueType.ARRAY:
            w.add_array(key, *value)  # (element type, values)
        else:
            w.add_value(key, vtype, value)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write(path)
    return path


def _pair(tiny_dense, rank: int = 2, extra: tuple = ()):
    import numpy as np

    from pyllama_spec.gguf.reader import read_gguf

    n_in, n_out = read_gguf(tiny_dense.target).tensors["output.weight"].dims
    return {"output.weight.lora_a": np.zeros((*extra, rank, n_in), np.float32),
            "output.weight.lora_b": np.zeros((*extra, n_out, rank), np.float32)}


ADAPTER_KEYS = {"general.type": (ValueType.STRING, "adapter"), "general.architecture": (ValueType.STRING, "hunyuan_vl"),
                "adapter.type": (ValueType.STRING, "lora"), "adapter.lora.alpha": (ValueType.FLOAT32, 2.0)}


@pytest.fixture(scope="module")
def bad_files(tiny_dense, tiny_dir, adapters):
    d = tiny_dir / "bad-lora"
    d.mkdir(exist_ok=True)
    (d / "notes.txt").write_text("not a model")
    wide = tiny.write_target(d / "wide-target.gguf", n_embd=128)
    return {
        "missing": (d / "missing.gguf", "not found"),
        "not GGUF": (d / "notes.txt", "not a GGUF"),
        "a model, not an adapter": (tiny_dense.target, "not an adapter"),
        "another architecture": (tiny_lora.write_lora(d / "qwen35.gguf", tiny_dense.target, arch="qwen35"),
                                 "'qwen35' architecture"),
        "another shape": (tiny_lora.write_lora(d / "wide.gguf", wide), "incorrect shape"),
        "not LoRA": (_write(d / "cvec.gguf", {**ADAPTER_KEYS, "adapter.type": (ValueType.STRING, "control_vector")},
                            _pair(tiny_dense)), "not a LoRA adapter"),
        "a pair missing its half": (_write(d / "half.gguf", ADAPTER_KEYS,
                                           {"output.weight.lora_a": _pair(tiny_dense)["output.weight.lora_a"]}),
                                    "missing one component"),
        "aLoRA": (_write(d / "alora.gguf", {**ADAPTER_KEYS, "adapter.alora.invocation_tokens":
                                            (ValueType.ARRAY, (ValueType.UINT32, [1, 2]))}, _pair(tiny_dense)),
                  "aLoRA"),
        "a key of the wrong type": (_write(d / "typed.gguf", {**ADAPTER_KEYS, "general.type": (ValueType.UINT32, 1)},
                                           _pair(tiny_dense)), "stored as UINT32"),
        "a 3-D pair": (_write(d / "3d.gguf", ADAPTER_KEYS, _pair(tiny_dense, extra=(2,))), "2-D matrices"),
    }


@pytest.mark.parametrize("case", ["missing", "not GGUF", "a model, not an adapter", "another architecture",
                                  "another shape", "not LoRA", "a pair missing its half", "aLoRA",
                                  "a key of the wrong type", "a 3-D pair"])
def test_a_bad_adapter_file_is_a_clear_error_at_load_naming_the_file(tiny_dense, bad_files, case):
    path, says = bad_files[case]
    with pytest.raises(ModelFileError, match=says) as e:
        ps.load(tiny_dense.target, draft=tiny_dense.draft, lora=[path], **KW)
    assert path.name in str(e.value)


@pytest.mark.parametrize("case", ["a key of the wrong type", "a 3-D pair"])
def test_the_files_refused_first_would_abort_llama_cpp(tiny_dense, bad_files, run_python, case):
    """Why check_adapter_file refuses them: handed to llama.cpp, they abort the process (at load,
    or at the first decode); through the engine, the same file is a clean error."""
    path = bad_files[case][0]
    raw = run_python(f"""
        from pyllama_spec._native import ffi, lib
        from pyllama_spec.bindings.context import Context
        from pyllama_spec.bindings.model import Model
        m = Model({str(tiny_dense.target)!r})
        ad = lib.llama_adapter_lora_init(m.ptr, {str(path)!r}.encode())
        ctx = Context(m, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1)
        lib.llama_set_adapters_lora(ctx.ptr, ffi.new("struct llama_adapter_lora *[]", [ad]), 1, ffi.new("float[]", [1.0]))
        ctx.decode_tokens([1, 2], [0, 1], outputs=[False, True])
        print("survived")
    """)
    assert raw.returncode == -6 and "survived" not in raw.stdout, explain_child(raw)
    checked = run_python(f"""
        import pyllama_spec as ps
        from pyllama_spec.errors import ModelFileError
        try:
            ps.load({str(tiny_dense.target)!r}, lora=[{str(path)!r}], n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1)
        except ModelFileError as e:
            print("refused:", e)
    """)
    assert checked.returncode == 0 and "refused:" in checked.stdout, explain_child(checked)


def test_bad_lora_settings_are_refused_at_load(tiny_dense, adapters):
    for bad in ([(adapters[0], float("nan"))], [(adapters[0], "1")], [3]):
        with pytest.raises(ValueError, match="lora|LoRA"):
            ps.load(tiny_dense.target, lora=bad, **KW)


# --------------------------------------------------------------------------- the command line


def test_lora_flags_are_read_as_llama_server_reads_them_in_command_line_order():
    from pyllama_spec.cli import options
    from pyllama_spec.cli.serve import serve

    ctx = serve.make_context("serve", ["-m", "t.gguf", "--lora-scaled", "b.gguf:0.5", "--lora", 'a.gguf,"c,d.gguf"',
                                       "--lora-scaled", "e.gguf:2,f.gguf:0", "--lora-init-without-apply"])
    with ctx:
        assert options.lora_adapters(ctx.params) == [("b.gguf", 0.5), ("a.gguf", 1.0), ("c,d.gguf", 1.0),
                                                     ("e.gguf", 2.0), ("f.gguf", 0.0)]
    assert ctx.params["lora_init_without_apply"] is True
    with pytest.raises(Exception, match="FNAME:SCALE"):
        serve.make_context("serve", ["-m", "t.gguf", "--lora-scaled", "b.gguf"])


def test_generate_applies_the_lora_flags(tiny_dense, adapters):
    from click.testing import CliRunner

    from pyllama_spec.cli.generate import generate

    args = ["-m", str(tiny_dense.target), "-p", PROMPTS[0], "--raw", "-n", str(N_PREDICT), "-c", "1024", "-b", "64",
            "-ub", "64", "-t", str(N_THREADS), "--json", "--lora-scaled", f"{adapters[0]}:0.5"]
    out = CliRunner().invoke(generate, args)
    assert out.exit_code == 0, out.output
    assert json.loads(out.output.strip().splitlines()[-1])["text"] == greedy(tiny_dense.target, PROMPTS[0],
                                                                             lora=[(adapters[0], 0.5)])


# --------------------------------------------------------------------------- the server




@pytest.fixture
def server(tiny_dense, adapters):
    pytest.importorskip("starlette", reason="the server needs the 'server' extra")
    from serving import LocalServer

    from pyllama_spec.server import ServerSettings

    engine = ps.load(tiny_dense.target, draft=tiny_dense.draft, lora=[str(adapters[0]), (str(adapters[1]), 0.5)],
                     n_parallel=2, **KW)
    srv = LocalServer(engine, ServerSettings(alias="tiny"))
    yield srv
    srv.stop()
    engine.close()


def _completion(url: str, prompt: str, **fields) -> str:
    status, body = http(url, "/completion", {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, **fields})
    assert status == 200, body
    return body["content"]


def test_get_lora_adapters_lists_them_as_llama_server_does(server, adapters):
    status, body = http(server.url, "/lora-adapters")
    assert status == 200
    assert body == [{"id": 0, "path": str(adapters[0]), "scale": 1.0, "task_name": "", "prompt_prefix": ""},
                    {"id": 1, "path": str(adapters[1]), "scale": 0.5, "task_name": "poems",
                     "prompt_prefix": "Write a poem: "}]


def test_post_lora_adapters_sets_the_global_scales(server, tiny_dense, adapters):
    assert http(server.url, "/lora-adapters", [{"id": 1, "scale": 1.0}]) == (200, {"success": True})
    assert [a["scale"] for a in http(server.url, "/lora-adapters")[1]] == [0.0, 1.0]  # not named: 0
    assert _completion(server.url, PROMPTS[0]) == greedy(tiny_dense.target, PROMPTS[0], lora=[adapters[1]])


def test_a_requests_lora_overrides_the_global_scales_for_that_request(server, tiny_dense, adapters):
    with ps.load(tiny_dense.target, lora=list(adapters), **KW) as e:
        want = {k: e.generate(PROMPTS[0], max_tokens=N_PREDICT, lora=s).text
                for k, s in (("global", [{"id": 0, "scale": 1}, {"id": 1, "scale": 0.5}]),
                             ("a half", [{"id": 0, "scale": 0.5}]))}
    assert _completion(server.url, PROMPTS[0], lora=[{"id": 0, "scale": 0.5}]) == want["a half"]
    assert _completion(server.url, PROMPTS[0]) == want["global"]
    status, body = http(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 4, "lora": [{"id": 1, "scale": 0.25}]})
    assert status == 200, body


def test_two_requests_with_different_adapters_at_once_each_get_their_own_answer(server, tiny_dense, adapters):
    asks = [[{"id": 0, "scale": 1.0}], [{"id": 1, "scale": 1.0}], [{"id": 0, "scale": 0.5}], []]
    with ps.load(tiny_dense.target, lora=list(adapters), **KW) as e:
        want = [e.generate(p, max_tokens=N_PREDICT, lora=s).text for p in PROMPTS for s in asks]
    got = [None] * len(want)

    def ask(k: int) -> None:
        got[k] = _completion(server.url, PROMPTS[k // len(asks)], lora=asks[k % len(asks)])

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(want))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want


@pytest.mark.parametrize("path,body,raw,says", [
    ("/lora-adapters", {"id": 0, "scale": 1}, None, "Request body must be an array"),
    ("/lora-adapters", [{"id": 2, "scale": 1}], None, "names no LoRA adapter"),
    ("/lora-adapters", [{"id": 0, "scale": "high"}], None, "finite number"),
    ("/lora-adapters", None, b"[{\"id\": 0, \"scale\": Infinity}]", "finite number"),
    ("/lora-adapters", [0], None, "must be an object"),
    ("/lora-adapters", None, b"[{", "not valid JSON"),
    ("/completion", {"prompt": "x", "lora": [{"id": 5, "scale": 1}]}, None, "names no LoRA adapter"),
    ("/completion", {"prompt": "x", "lora": {"id": 0, "scale": 1}}, None, "must be an array"),
    ("/completion", {"prompt": "x", "lora": [{"id": "0", "scale": 1}]}, None, "names no LoRA adapter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "lora": [{"id": -1}]}, None,
     "names no LoRA adapter"),
])
def test_bad_lora_requests_are_400s_and_change_nothing(server, path, body, raw, says):
    status, answer = http(server.url, path, body, raw)
    assert status == 400 and says in answer["error"]["message"], answer
    assert [a["scale"] for a in http(server.url, "/lora-adapters")[1]] == [1.0, 0.5]


def test_an_adapter_free_server_lists_none_and_refuses_a_lora_id(tiny_dense):
    pytest.importorskip("starlette", reason="the server needs the 'server' extra")
    from serving import LocalServer

    from pyllama_spec.server import ServerSettings

    with ps.load(tiny_dense.target, **KW) as engine:
        srv = LocalServer(engine, ServerSettings())
        try:
            assert http(srv.url, "/lora-adapters") == (200, [])
            assert http(srv.url, "/lora-adapters", []) == (200, {"success": True})
            status, body = http(srv.url, "/completion", {"prompt": "x", "lora": [{"id": 0, "scale": 1}]})
            assert status == 400 and "--lora" in body["error"]["message"]
        finally:
            srv.stop()


# --------------------------------------------------------------------------- llama-server itself


@pytest.fixture(scope="module")
def both_servers(tiny_dense, adapters):
    """The pinned llama-server (target alone) and this server (target + DFlash draft), each with
    ``--lora A --lora-scaled B:0.5``, the paths written the same way."""
    pytest.importorskip("starlette", reason="the server needs the 'server' extra")
    from serving import LocalServer
    from test_llama_server_parity import _Process

    from pyllama_spec.server import ServerSettings

    a, b = str(adapters[0]), str(adapters[1])
    theirs = _Process(["-m", str(tiny_dense.target), "-c", "1024", "-np", "1", "--no-warmup", "-t", str(N_THREADS),
                       "--lora", a, "--lora-scaled", f"{b}:0.5"])
    engine = ps.load(tiny_dense.target, draft=tiny_dense.draft, lora=[a, (b, 0.5)], **KW)
    ours = LocalServer(engine, ServerSettings(alias="tiny"))
    yield ours.url, theirs.url
    ours.stop()
    engine.close()
    theirs.stop()


@needs_llama_server
def test_get_lora_adapters_body_matches_llama_servers(both_servers):
    ours, theirs = (http(url, "/lora-adapters") for url in both_servers)
    assert ours == theirs and ours[0] == 200


@needs_llama_server
@pytest.mark.parametrize("lora", [None, [{"id": 1, "scale": 1.0}], [{"id": 0, "scale": 0.5}],
                                  [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}]])
def test_greedy_output_with_lora_and_lora_scaled_matches_llama_servers(both_servers, lora):
    fields = {"cache_prompt": False} | ({} if lora is None else {"lora": lora})
    for prompt in PROMPTS:
        ours, theirs = (_completion(url, prompt, **fields) for url in both_servers)
        assert ours == theirs


@needs_llama_server
def test_post_lora_adapters_then_output_and_list_match_llama_servers(both_servers):
    for url in both_servers:
        assert http(url, "/lora-adapters", [{"id": 1, "scale": 0.75}]) == (200, {"success": True})
    try:
        ours, theirs = (http(url, "/lora-adapters") for url in both_servers)
        assert ours == theirs
        # cache_prompt false: the pinned llama-server reuses a slot's cache decoded under the old
        # scales when a request has no lora field; this server does not (serving/lora.py)
        for prompt in PROMPTS:
            ours, theirs = (_completion(url, prompt, cache_prompt=False) for url in both_servers)
            assert ours == theirs
        assert http(both_servers[0], "/lora-adapters", {"id": 0})[0] == http(both_servers[1], "/lora-adapters",
                                                                          {"id": 0})[0] == 400
    finally:
        for url in both_servers:
            http(url, "/lora-adapters", [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}])
