#!/usr/bin/env python3
"""One program written for llama-cpp-python, run twice: on the real llama-cpp-python 0.3.36 and on
``pyllama_spec.llama_cpp`` (``sys.modules["llama_cpp"]`` pointed at the facade). Same files, same calls.

    /path/to/venv/bin/pip install --no-build-isolation ~/.cache/pyllama-spec/downloads/llama_cpp_python-0.3.36.tar.gz
    python bench/llama_cpp_side_by_side.py --real-python /path/to/venv/bin/python --repeats 3

The program (``PROGRAM`` below, the embedded pair's files): greedy completions of held-out code prompts,
a chat with a picture through ``MTMDChatHandler`` (both render the GGUF's template) and through
``Qwen25VLChatHandler`` (both render its own template, llama-cpp-python's, copied into the facade),
the same completions and the picture chat with ``LlamaPromptLookupDecoding`` and with a ``LlamaDraftModel``
of one's own (``SmallModelDraft``: the draft model file's greedy tokens, as llama-cpp-python's users
write one), a text chat through the
named format ``chat_format="chatml"`` (without and with prompt lookup); on the facade also with each
of this project's draft models (DFlash, EAGLE3, a draft model that sees the picture through its own
projector). Each timed call runs ``--repeats`` times on one ``Llama``, as a program would: both packages
may reuse the cached prompt on a repeat (the facade's engine reuses a picture's too). Printed:
whether each output equals the other engine's and the run without a draft, and tokens/s
(completion tokens over the call's wall time) min/median/max over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROGRAM = r'''
import base64, io, json, os, sys, time
import numpy as np
import llama_cpp
from llama_cpp.llama_chat_format import MTMDChatHandler, Qwen25VLChatHandler
from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

M, PROMPTS, PICTURE, REPEATS, FACADE = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] == "facade"
T, MM = M + "/trained-target.gguf", M + "/trained-mmproj.gguf"
KW = dict(n_ctx=2048, n_threads=1, n_threads_batch=1, verbose=False)
results = {}

def timed(name, llm, call):
    texts, speeds = None, []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        try:
            outs = call(llm)
        except Exception as e:  # recorded: the table says which engine failed and how
            results[name] = dict(error=f"{type(e).__name__}: {e}")
            return
        wall = time.perf_counter() - t0
        speeds.append(sum(o["usage"]["completion_tokens"] for o in outs) / wall)
        texts = [o["choices"][0].get("text", o["choices"][0].get("message", {}).get("content")) for o in outs]
    results[name] = dict(texts=texts, speeds=sorted(speeds))

def completions(llm):
    return [llm(p, max_tokens=64, temperature=0.0) for p in PROMPTS]

with open(PICTURE, "rb") as f:
    url = "data:image/png;base64," + base64.b64encode(f.read()).decode()

def chat(llm):
    return [llm.create_chat_completion(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": p[:200]}]}],
        max_tokens=64, temperature=0.0) for p in PROMPTS[:2]]

llm = llama_cpp.Llama(T, **KW)
timed("completion", llm, completions)
llm.close()
llm = llama_cpp.Llama(T, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10), **KW)
timed("completion, prompt lookup", llm, completions)
llm.close()
for handler in (MTMDChatHandler, Qwen25VLChatHandler):
    llm = llama_cpp.Llama(T, chat_handler=handler(clip_model_path=MM, verbose=False), **KW)
    timed(f"chat with a picture, {handler.__name__}", llm, chat)
    llm.close()
llm = llama_cpp.Llama(T, chat_handler=MTMDChatHandler(clip_model_path=MM, verbose=False),
                      draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10), **KW)
timed("chat with a picture, MTMDChatHandler, prompt lookup", llm, chat)
llm.close()

def formatted_chat(llm):
    return [llm.create_chat_completion(messages=[{"role": "system", "content": "You write Python."},
                                                 {"role": "user", "content": p[:200]}],
                                       max_tokens=64, temperature=0.0) for p in PROMPTS]

class SmallModelDraft(LlamaDraftModel):
    """A draft model of one's own, as llama-cpp-python's users write one: a smaller model's greedy tokens."""

    def __init__(self, path, num_pred_tokens=7):
        self.small = llama_cpp.Llama(path, **KW)
        self.n = num_pred_tokens

    def __call__(self, input_ids, /, **kwargs):
        out = []
        for token in self.small.generate(list(input_ids), temp=0.0):
            out.append(token)
            if len(out) == self.n:
                break
        return np.array(out, dtype=np.intc)

llm = llama_cpp.Llama(T, draft_model=SmallModelDraft(M + "/trained-draft-vlm.gguf"), **KW)
timed("completion, a LlamaDraftModel of one's own", llm, completions)
llm.close()
llm = llama_cpp.Llama(T, chat_handler=MTMDChatHandler(clip_model_path=MM, verbose=False),
                      draft_model=SmallModelDraft(M + "/trained-draft-vlm.gguf"), **KW)
timed("chat with a picture, MTMDChatHandler, a LlamaDraftModel of one's own", llm, chat)
llm.close()

for lookup in (False, True):
    llm = llama_cpp.Llama(T, chat_format="chatml", **KW,
                          **({"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=10)} if lookup else {}))
    timed("chat, chat_format chatml" + (", prompt lookup" if lookup else ""), llm, formatted_chat)
    llm.close()
if FACADE:
    from llama_cpp.llama_speculative import DFlashDraft, DraftModel, Eagle3Draft, MTPDraft
    drafts = {"DFlash": lambda seeing: DFlashDraft(M + "/trained-draft.gguf", num_pred_tokens=7),
              "EAGLE3": lambda seeing: Eagle3Draft(M + "/trained-eagle3.gguf", num_pred_tokens=7),
              "draft model": lambda seeing: DraftModel(M + "/trained-draft-vlm.gguf", num_pred_tokens=7,
                                                       clip_model_path=M + "/trained-draft-vlm-mmproj.gguf" if seeing
                                                       else None)}
    for name, draft in drafts.items():
        llm = llama_cpp.Llama(T, draft_model=draft(False), **KW)
        timed(f"completion, {name}", llm, completions)
        llm.close()
        llm = llama_cpp.Llama(T, chat_handler=MTMDChatHandler(clip_model_path=MM), draft_model=draft(True), **KW)
        timed(f"chat with a picture, MTMDChatHandler, {name}", llm, chat)
        llm.close()
print(json.dumps(results))
'''


def run(python: list[str], models: Path, prompts: list[str], picture: Path, repeats: int, mode: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(PROGRAM)
    res = subprocess.run([*python, f.name, str(models), json.dumps(prompts), str(picture), str(repeats), mode],
                         capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise SystemExit(f"the program failed on {mode}:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    sys.path.insert(0, str(REPO / "tools"))
    from measure_trained_pair import held_out_prompts

    from pyllama_spec.embedded import MODELS_DIR, draw_demo_image

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real-python", required=True, help="a Python with llama-cpp-python 0.3.36 installed")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    prompts = held_out_prompts(args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        picture = Path(tmp) / "card.png"
        draw_demo_image(448).save(picture)
        shim = ("import sys, runpy, pyllama_spec.llama_cpp; sys.modules['llama_cpp'] = pyllama_spec.llama_cpp; "
                "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
        real = run([args.real_python], MODELS_DIR, prompts, picture, args.repeats, "real")
        ours = run([sys.executable, "-c", shim], MODELS_DIR, prompts, picture, args.repeats, "facade")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(real=real, facade=ours), indent=1) + "\n")
    base = ours["completion"]["texts"]
    print("| run | engine | same text as llama-cpp-python | same text as no draft | tokens/s min / median / max |")
    print("|---|---|---|---|---|")
    for name in ours:
        for engine, got in (("llama-cpp-python", real.get(name)), ("pyllama_spec.llama_cpp", ours[name])):
            if got is None:
                continue
            if "error" in got:
                print(f"| {name} | {engine} | failed: {got['error'][:120]} | | |")
                continue
            same_real = "" if name not in real or "error" in real[name] else \
                ("yes" if got["texts"] == real[name]["texts"] else "NO")
            plain = (ours if engine != "llama-cpp-python" else real)
            # the run without a draft of the same kind (the longest such name that begins this one)
            kind = max((k for k in ("completion", "chat, chat_format chatml", "chat with a picture, MTMDChatHandler",
                                    "chat with a picture, Qwen25VLChatHandler") if name.startswith(k)), key=len)
            ref = plain.get(kind, {}).get("texts")
            same_plain = "yes" if got["texts"] == (ref if ref is not None else base) else "NO"
            s = got["speeds"]
            print(f"| {name} | {engine} | {same_real} | {same_plain} | {s[0]:.0f} / {s[len(s) // 2]:.0f} / {s[-1]:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
