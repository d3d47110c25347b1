"""Ctrl-C reaches the caller from every phase, promptly, and leaves the engine usable.

A KeyboardInterrupt raised inside a cffi callback (native logs, mtmd's post-decode hook)
is swallowed by cffi; a long native call (a big decode, an image encode) runs no Python
code at all. Each case runs in a child interpreter (signals are real there: SIGINT from
a timer thread to the process, handled on the main thread) and prints what it saw.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

CHILD = r"""
import json, os, signal, sys, threading, time
import numpy as np
import pyllama_spec as ps

target, mmproj, draft, case = sys.argv[1:5]
out = {}

def interrupt_after(seconds):
    threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT)).start()

# Where a case compares how far the work went before and after Ctrl-C, it counts this process's
# CPU seconds, not the wall clock: on a loaded machine other processes stretch the wall clock
# (of one run more than of the other), not the work done here.

def interrupt_after_cpu(seconds, phase=lambda: None):
    # SIGINT once this process has spent `seconds` more CPU time; out["at_cpu"]: its CPU clock
    # then, out["sent_in"]: what phase() says at that moment.
    start = time.process_time()

    def watch():
        while time.process_time() - start < seconds:
            time.sleep(0.001)
        out["at_cpu"], out["sent_in"] = time.process_time(), phase()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()

def timed(fn):
    # fn's outcome and wall seconds; out["cpu_start"] / out["cpu_end"]: the CPU clock around it
    out["cpu_start"] = time.process_time()
    t0 = time.perf_counter()
    try:
        fn()
        outcome = "finished"
    except KeyboardInterrupt:
        outcome = "interrupted"
    out["cpu_end"] = time.process_time()
    return outcome, time.perf_counter() - t0

if case == "one-long-decode":
    n = 4096
    with ps.Model(target) as model:
        ctx = ps.Context(model, n_ctx=n, n_batch=n, n_ubatch=n, n_threads=1)
        tokens, pos = np.arange(n) % 200 + 10, np.arange(n)
        timed(lambda: ctx.decode_tokens(tokens, pos))
        out["full"] = out["cpu_end"] - out["cpu_start"]  # CPU seconds
        ctx.memory.clear()
        interrupt_after_cpu(out["full"] / 8)
        out["outcome"], out["wall"] = timed(lambda: ctx.decode_tokens(tokens, pos))
        out["elapsed"] = out["cpu_end"] - out["cpu_start"]
        ctx.memory.clear()
        ctx.decode_tokens(tokens[:8], pos[:8], outputs=True)  # the context still works
        out["after"] = int(ctx.memory.pos_max())

elif case in ("image-encode", "image-prefill"):
    side = 672
    img = (np.random.default_rng(0).random((side, side, 3)) * 255).astype(np.uint8)
    prompt = f"Look: {ps.MEDIA_MARKER} and say"
    # The encode stops between graph nodes. The projector here has 8 vision blocks, flash attention off:
    # the tiny projector's one block is a few large nodes (its 16-wide heads make the attention's
    # product of keys and queries half of the encode), a real encoder's dozens of layers are not.
    with ps.load(target, mmproj=mmproj, draft=draft, n_ctx=8192, n_batch=64, n_ubatch=64, n_threads=1,
                 draft_max=7, mmproj_flash_attn=False) as engine:
        # CPU seconds from the start of generate to each progress report
        c0, phases = time.process_time(), []
        expected = engine.generate(prompt, images=[img], max_tokens=8,
                                   progress=lambda s, d, t: phases.append((s, time.process_time() - c0)))
        out["full"] = time.process_time() - c0
        encode_start = next(t for s, t in phases if s == "encode")
        encode_end = next(t for s, t in phases if s == "prefill" and t > encode_start)
        out["encode_seconds"] = encode_end - encode_start
        engine.reset_cache()
        # Land the Ctrl-C in the middle of the image's encode (30% of its work in), or in its decode
        # slices, counted from where this run reports that phase.
        seen, armed = [], []

        def progress(stage, done, total):
            seen.append(stage)
            starts = stage == "encode" if case == "image-encode" else stage == "prefill" and "encode" in seen
            if starts and not armed:
                armed.append(stage)
                interrupt_after_cpu(0.3 * out["encode_seconds"] if case == "image-encode" else 0.05,
                                    lambda: seen[-1])

        out["outcome"], out["wall"] = timed(
            lambda: engine.generate(prompt, images=[img], max_tokens=100_000, progress=progress))
        out["elapsed"] = out["cpu_end"] - out["cpu_start"]
        out["at"] = out["at_cpu"] - out["cpu_start"]
        out["same_after"] = engine.generate(prompt, images=[img], max_tokens=8).tokens == expected.tokens

elif case == "slots":
    # Two slots: the main thread reads one long submission, a worker thread reads another.
    with ps.load(target, mmproj=mmproj, draft=draft, n_ctx=8192, n_batch=64, n_ubatch=64, n_threads=1,
                 draft_max=7, n_parallel=2) as engine:
        expected = engine.generate("Tell me", max_tokens=16).tokens
        expected_other = engine.generate("Another one", max_tokens=3000).tokens
        engine.reset_cache()
        other_outcome = []

        def read_other(sub):
            try:
                got = sub.result().tokens
                other_outcome.append("finished" if got == expected_other else "finished with other tokens")
            except BaseException as e:  # what a thread sharing the engine sees
                other_outcome.append(type(e).__name__)

        other = engine.submit("Another one", max_tokens=3000)
        reader = threading.Thread(target=read_other, args=(other,))
        reader.start()
        mine = engine.submit("Tell me", max_tokens=100_000)
        it = iter(mine)
        next(it)
        interrupt_after(0.3)
        out["outcome"], out["elapsed"] = timed(lambda: [None for _ in it])
        reader.join(60)
        out["other"] = other_outcome
        t0 = time.perf_counter()
        while engine.scheduler.n_active and time.perf_counter() - t0 < 10:
            time.sleep(0.01)
        out["slots_freed"] = engine.scheduler.n_active == 0
        out["same_after"] = engine.generate("Tell me", max_tokens=16).tokens == expected

elif case == "tree":
    # A draft tree on the trained pair: Ctrl-C lands in a step (its decode, its walk or the
    # branch cleanup); the branches must not stay in the cache.
    m = ps.embedded_models()
    with ps.load(m.target, draft=m.draft, n_ctx=4096, n_batch=128, n_ubatch=128, n_threads=1, draft_max=15,
                 draft_tree=64) as engine:
        kw = dict(temperature=0.8, seed=2)
        expected = engine.generate(ps.embedded.PROMPT, max_tokens=24, draft_max=0, **kw).tokens
        interrupt_after(0.5)
        out["outcome"], out["elapsed"] = timed(
            lambda: engine.generate(ps.embedded.PROMPT, max_tokens=3800, cache_prompt=False, **kw))
        mem = engine.ctx.memory
        out["branches_left"] = [s for s in range(1, 65) if mem.pos_max(s) >= 0]
        out["same_after"] = engine.generate(ps.embedded.PROMPT, max_tokens=24, **kw).tokens == expected

elif case == "own-handler":
    seen = []
    signal.signal(signal.SIGINT, lambda *a: seen.append(1))
    n = 2048
    with ps.Model(target) as model:
        ctx = ps.Context(model, n_ctx=n, n_batch=n, n_ubatch=n, n_threads=1)
        tokens, pos = np.arange(n) % 200 + 10, np.arange(n)
        c0 = time.process_time(); ctx.decode_tokens(tokens, pos); full = time.process_time() - c0
        ctx.memory.clear()
        interrupt_after_cpu(full / 8)
        out["outcome"], out["elapsed"] = timed(lambda: ctx.decode_tokens(tokens, pos))
        time.sleep(0.05)
        out["handler_ran"] = bool(seen)
        out["rows"] = int(ctx.memory.pos_max()) + 1

print("RESULT " + json.dumps(out))
"""


def _run(run_python, models, case):
    res = run_python(CHILD, str(models.target), str(models.mmproj), str(models.draft), case, timeout=240)
    assert "Exception ignored" not in res.stderr, res.stderr[-2000:]
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert res.returncode == 0 and line, f"rc={res.returncode}\n{res.stdout[-1500:]}\n{res.stderr[-3000:]}"
    out = json.loads(line[len("RESULT "):])
    print(case, out)  # the figures, for the record (pytest -s)
    return out


def test_ctrl_c_stops_one_long_decode_between_graph_nodes(tiny_dense, run_python):
    out = _run(run_python, tiny_dense, "one-long-decode")
    assert out["outcome"] == "interrupted"
    # Stopped well before the decode would have finished (it was sent at 1/8 of it); CPU seconds,
    # which load from other processes does not stretch.
    assert out["elapsed"] < 0.6 * out["full"], out
    assert out["after"] == 7


@pytest.mark.parametrize("case", ["image-encode", "image-prefill"])
def test_ctrl_c_during_an_image_prompt_reaches_the_caller_and_the_engine_goes_on(case, tiny_dense, run_python,
                                                                                 tmp_path):
    from pyllama_spec.devtools import tiny

    # tiny_dense's projector with 8 vision blocks (see the child's comment)
    models = dataclasses.replace(tiny_dense, mmproj=tiny.write_mmproj(tmp_path / "mmproj-8-blocks.gguf", n_block=8))
    out = _run(run_python, models, case)
    assert out["outcome"] == "interrupted", out  # not lost in a callback, not run to max_tokens
    if case == "image-encode":
        # Sent 30% into the encode, the interrupt came back well before the encode would have
        # ended (at 100%): the encode itself stopped, between two of its graph nodes. CPU seconds
        # (the child's): on a loaded machine the wall clock of one run stretches, not its work.
        assert out["sent_in"] == "encode" and out["elapsed"] - out["at"] < 0.6 * out["encode_seconds"], out
    assert out["elapsed"] < out["full"] + 1.0, out
    assert out["same_after"]


def test_ctrl_c_while_slots_generate_reaches_the_reader_and_the_slots_go_on(tiny_dense, run_python):
    """The main thread's reader gets KeyboardInterrupt within moments; a thread reading another
    slot sees its generation end cleanly (finished, cancelled, or failed with the interrupted
    step), never a hang; the slots free and the next request gives its sequential answer."""
    out = _run(run_python, tiny_dense, "slots")
    assert out["outcome"] == "interrupted" and out["elapsed"] < 5, out
    assert out["other"] and out["other"][0] in ("finished", "GenerationCancelledError", "KeyboardInterrupt",
                                                "NativeCallError"), out
    assert out["slots_freed"] and out["same_after"], out


def test_ctrl_c_during_draft_tree_steps_leaves_no_branch_in_the_cache(tiny_dense, run_python):
    out = _run(run_python, tiny_dense, "tree")
    assert out["outcome"] == "interrupted" and out["elapsed"] < 5, out
    assert out["branches_left"] == [] and out["same_after"], out


def test_a_program_with_its_own_sigint_handler_keeps_its_decode(tiny_dense, run_python):
    out = _run(run_python, tiny_dense, "own-handler")
    assert out["outcome"] == "finished" and out["handler_ran"] and out["rows"] == 2048
