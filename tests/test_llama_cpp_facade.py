"""``pyllama_spec.llama_cpp``, the llama-cpp-python facade, used as llama-cpp-python's users use it.

* llama-cpp-python 0.3.36's own tests run against it (``sys.modules["llama_cpp"]`` pointed at the
  facade), from the sdist the build cache downloads: the ones this first part of the facade covers;
* completions and chats give the engine's own greedy text in llama-cpp-python's response shapes,
  streamed or not; a chat with a picture through a vision chat handler, the picture as a data URI;
* every drafter as a ``draft_model`` (prompt lookup, DFlash, EAGLE3, MTP, a draft model) gives the same
  greedy text as no draft, with its drafting statistics in the response;
* what the facade cannot do yet is refused with the reason, never silently dropped.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import warnings

import numpy as np
import pytest
from conftest import N_THREADS, REPO_ROOT

import pyllama_spec as ps
from pyllama_spec import llama_cpp
from pyllama_spec.embedded import MODELS_DIR
from pyllama_spec.llama_cpp import llama_speculative as spec
from pyllama_spec.llama_cpp.llama_chat_format import MTMDChatHandler, Qwen25VLChatHandler

TARGET = str(MODELS_DIR / "trained-target.gguf")
MMPROJ = str(MODELS_DIR / "trained-mmproj.gguf")
QWEN35 = str(MODELS_DIR / "trained-qwen35-mtp.gguf")
PROMPT = "def read_config(path):\n"
KW = dict(n_ctx=1024, n_threads=N_THREADS, verbose=False)


@pytest.fixture(scope="module")
def llm():
    with llama_cpp.Llama(TARGET, **KW) as model:
        yield model


@pytest.fixture(scope="module")
def greedy(llm):
    return llm(PROMPT, max_tokens=24, temperature=0.0)["choices"][0]["text"]


# ----------------------------------------------------------------------------- llama-cpp-python's own tests

def test_llama_cpp_pythons_own_tests_pass_as_on_the_real_package(tmp_path):
    """Its whole tests/ folder, unchanged, on local stand-ins for the Hub models
    (devtools/llama_cpp_python_suite.py): every test the real llama-cpp-python 0.3.36 passed on the same
    stand-ins (bench/llama_cpp_python_real_0.3.36.json, recorded with the command in bench/RESULTS.md)
    passes against the facade (its embedding test on the tiny BERT of devtools/tiny_bert.py, its
    recurrent-only tests on the tiny Mamba of devtools/tiny_mamba.py). Those both fail assert a
    downloaded model's exact words or drive the raw ctypes bindings."""
    pytest.importorskip("jinja2", reason="its chat-format tests render with Jinja2 (the llama-cpp extra)")
    pytest.importorskip("scipy", reason="its test_llama.py imports scipy (the test extra)")
    from pyllama_spec.devtools import llama_cpp_python_suite as suite

    if not suite.sdist_path().exists():
        pytest.skip(f"{suite.sdist_path()} is not in the build cache (python build.py downloads it)")
    real = json.loads((REPO_ROOT / "bench" / "llama_cpp_python_real_0.3.36.json").read_text())
    ours = suite.run(suite.prepare(tmp_path, facade=True), timeout=600)
    assert set(ours) == set(real), sorted(set(ours) ^ set(real))
    lost = sorted(t for t, outcome in real.items() if outcome == "passed" and ours[t] != "passed")
    assert not lost, lost
    assert sum(o == "passed" for o in ours.values()) >= 23


def test_import_llama_cpp_finds_the_facade(run_python):
    """With ``sys.modules["llama_cpp"]`` pointed at the facade, its submodules are the facade's own (a
    second copy would hold other classes: a draft model made from one would be refused by the other)."""
    res = run_python("import sys, pyllama_spec.llama_cpp\nsys.modules['llama_cpp'] = pyllama_spec.llama_cpp\n"
                     "import llama_cpp\nfrom llama_cpp import Llama, LlamaGrammar\n"
                     "from llama_cpp.llama_speculative import LlamaPromptLookupDecoding\n"
                     "import llama_cpp.llama_chat_format as chat\n"
                     "import pyllama_spec.llama_cpp.llama_chat_format as ours\n"
                     f"llm = Llama({TARGET!r}, n_ctx=256, n_threads=1, verbose=False,\n"
                     "            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4))\n"
                     "print(llama_cpp.__version__, Llama.__module__, chat is ours)")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["0.3.36", "pyllama_spec.llama_cpp.llama", "True"]


def test_verbose_prints_llama_cpps_log_as_llama_cpp_python_does(run_python):
    """Llama(verbose=True), llama-cpp-python's default, prints llama.cpp's log to stderr; False does not."""
    code = ("from pyllama_spec.llama_cpp import Llama\n"
            f"llm = Llama({TARGET!r}, n_ctx=256, n_threads=1, verbose={{}})\n"
            "llm('def f(', max_tokens=2)\n")
    quiet, loud = (run_python(code.format(v)) for v in (False, True))
    assert quiet.returncode == loud.returncode == 0, loud.stderr[-2000:]
    assert "llama_context" not in quiet.stderr and "llama_context" in loud.stderr


# ----------------------------------------------------------------------------- completions

def test_a_completion_is_the_engines_greedy_text_in_llama_cpp_pythons_shape(llm, greedy):
    with ps.load(TARGET, n_ctx=1024, n_threads=N_THREADS, spec_type="none") as eng:
        assert greedy == eng.generate(PROMPT, max_tokens=24, temperature=0.0).text
    out = llm.create_completion(PROMPT, max_tokens=24, temperature=0.0)
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion" and out["model"] == TARGET
    assert isinstance(out["created"], int)
    (choice,) = out["choices"]
    assert choice == {"text": greedy, "index": 0, "logprobs": None, "finish_reason": "length"}
    assert out["usage"]["completion_tokens"] == 24
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 24
    # token ids as the prompt, and echo
    ids = llm.tokenize(PROMPT.encode())
    assert llm(ids, max_tokens=24, temperature=0.0)["choices"][0]["text"] == greedy
    assert llm(PROMPT, max_tokens=24, temperature=0.0, echo=True)["choices"][0]["text"] == PROMPT + greedy


def test_a_streamed_completion_comes_in_chunks_that_add_up(llm, greedy):
    chunks = list(llm(PROMPT, max_tokens=24, temperature=0.0, stream=True, echo=True))  # no echo in a stream
    assert len(chunks) > 1 and all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == greedy
    # llama-cpp-python's last chunk: no text, the finish reason (and here the drafting statistics)
    assert chunks[-1]["choices"][0] == {"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["speculative"]["generated_tokens"] == 24
    # a consumer that stops early and the next call
    it = llm(PROMPT, max_tokens=200, temperature=0.0, stream=True)
    next(it)
    it.close()
    assert llm(PROMPT, max_tokens=24, temperature=0.0)["choices"][0]["text"] == greedy


def test_stop_strings_seeds_logprobs_and_the_vocabulary(llm, greedy):
    word = greedy.strip().split()[0]
    cut = llm(PROMPT, max_tokens=24, temperature=0.0, stop=[word])["choices"][0]
    assert cut["finish_reason"] == "stop" and word not in cut["text"]
    # llama-cpp-python's seeds: a given seed is the Llama's from then on; without one, each call takes the
    # next seed of a chain (the same chain in every process)
    hot = dict(max_tokens=16, temperature=3.0, top_k=0, top_p=1.0, min_p=0.0)
    a = llm(PROMPT, seed=5, **hot)["choices"][0]["text"]
    assert a == llm(PROMPT, seed=5, **hot)["choices"][0]["text"]
    llm.set_seed(5)
    b, c = (llm(PROMPT, **hot)["choices"][0]["text"] for _ in range(2))
    assert b != c  # the chain moved on
    llm.set_seed(5)
    assert llm(PROMPT, **hot)["choices"][0]["text"] == b
    lp = llm(PROMPT, max_tokens=4, temperature=0.0, logprobs=2)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 4
    assert lp["text_offset"][0] == len(PROMPT)  # offsets count from the prompt's start, as there
    assert all(v <= 0 for v in lp["token_logprobs"])
    assert all(t in top and len(top) <= 3 for t, top in zip(lp["tokens"], lp["top_logprobs"]))
    assert "".join(lp["tokens"]) == llm(PROMPT, max_tokens=4, temperature=0.0)["choices"][0]["text"]
    text = "class Stack:\n    naïve = '日本'".encode()
    ids = llm.tokenize(text, add_bos=False)
    assert llm.detokenize(ids) == text and b"".join(llm.detokenize([t]) for t in ids) == text
    assert llm.n_ctx() == 1024 and llm.n_vocab() > 0 and llm.n_embd() > 0
    assert isinstance(llm.token_eos(), int)


def test_logprobs_come_a_token_each_even_where_the_text_is_held_back(llm, greedy):
    """A possible stop string holds text back: each token still has its own entry, its own text, in the
    stream (with the next chunk that has text) and in the whole answer, as in llama-cpp-python."""
    stop = greedy[5:12] + "#"  # a prefix the answer shows and never completes
    whole = llm(PROMPT, max_tokens=24, temperature=0.0, stop=[stop], logprobs=1)["choices"][0]
    assert "".join(whole["logprobs"]["tokens"]) == whole["text"] == greedy
    assert whole["logprobs"]["text_offset"] == [len(PROMPT) + len(greedy[:i]) for i in
                                               np.cumsum([0] + [len(t) for t in whole["logprobs"]["tokens"][:-1]])]
    chunks = list(llm(PROMPT, max_tokens=24, temperature=0.0, stop=[stop], logprobs=1, stream=True))
    entries = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert entries == whole["logprobs"]["tokens"] and len(entries) == 24


def test_seed_zero_and_none_are_llama_cpp_pythons_default(llm):
    for seed in (0, None):
        with llama_cpp.Llama(TARGET, seed=seed, **KW) as other:
            assert other._seed == llama_cpp.LLAMA_DEFAULT_SEED


def test_a_grammar_constrains_the_completion(llm):
    yes_no = llama_cpp.LlamaGrammar.from_string('root ::= "yes" | "no"')
    assert llm(PROMPT, max_tokens=8, temperature=0.0, grammar=yes_no)["choices"][0]["text"] in ("yes", "no")
    schema = llama_cpp.LlamaGrammar.from_json_schema(json.dumps({"enum": ["red", "green", "blue"]}))
    out = llm(PROMPT, max_tokens=32, temperature=0.0, grammar=schema)["choices"][0]
    assert out["finish_reason"] == "stop" and json.loads(out["text"]) in ("red", "green", "blue")
    with pytest.raises(ValueError, match="does not parse"):
        llama_cpp.LlamaGrammar.from_string('root ::= "unclosed')


# ----------------------------------------------------------------------------- chats

def _png_data_uri(picture: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(picture).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


PICTURE = (np.arange(224 * 224 * 3) % 251).astype(np.uint8).reshape(224, 224, 3)


@pytest.mark.parametrize("handler", [Qwen25VLChatHandler, MTMDChatHandler])
def test_a_chat_with_a_picture_is_the_engines_chat(handler, tmp_path):
    """The picture as a data URI through a vision chat handler: the engine's own greedy answer, in a
    chat.completion, to the same chat rendered as llama-cpp-python renders it: MTMDChatHandler with the
    model's template, Qwen25VLChatHandler with its own (a ChatML with a default system message)."""
    png = tmp_path / "p.png"
    from PIL import Image

    from pyllama_spec.serving.chat_template import MEDIA_MARKER

    Image.fromarray(PICTURE).save(png)
    text = {"type": "text", "text": "def describe(picture):"}
    with ps.load(TARGET, mmproj=MMPROJ, n_ctx=1024, n_threads=N_THREADS, spec_type="none") as eng:
        if handler is MTMDChatHandler:
            want = eng.generate(messages=[{"role": "user", "content": [{"type": "image", "image": str(png)}, text]}],
                                max_tokens=16, temperature=0.0, cache_prompt=False).text
        else:  # llama-cpp-python's Qwen2.5-VL template, the picture's URL replaced by the media marker
            # (Jinja drops the template's last newline, there as here)
            prompt = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                      f"{MEDIA_MARKER}def describe(picture):<|im_end|>\n<|im_start|>assistant")
            url = _png_data_uri(PICTURE)
            assert handler(clip_model_path=MMPROJ).render(
                [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, text]}],
                bos_token="", eos_token="") == (prompt, [url])
            want = eng.generate(prompt, images=[str(png)], max_tokens=16, temperature=0.0, cache_prompt=False).text
    with llama_cpp.Llama(TARGET, chat_handler=handler(clip_model_path=MMPROJ), **KW) as llm:
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_data_uri(PICTURE)}},
                                                 text]}]
        out = llm.create_chat_completion(messages=messages, max_tokens=16, temperature=0.0)
        assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
        assert out["choices"][0]["message"] == {"role": "assistant", "content": want}
        chunks = list(llm.create_chat_completion(messages=messages, max_tokens=16, temperature=0.0, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_json_response_format_gives_json(llm):
    out = llm.create_chat_completion(messages=[{"role": "user", "content": "a colour"}], max_tokens=32,
                                     temperature=0.0, response_format={
                                         "type": "json_object", "schema": {"enum": ["red", "green", "blue"]}})
    assert json.loads(out["choices"][0]["message"]["content"]) in ("red", "green", "blue")


# ----------------------------------------------------------------------------- drafts

@pytest.mark.parametrize("draft", ["prompt lookup", "dflash", "eagle3", "draft model"])
def test_every_draft_model_gives_the_same_greedy_text(draft, greedy):
    make = {"prompt lookup": lambda: spec.LlamaPromptLookupDecoding(num_pred_tokens=7),
            "dflash": lambda: spec.DFlashDraft(str(MODELS_DIR / "trained-draft.gguf"), num_pred_tokens=7),
            "eagle3": lambda: spec.Eagle3Draft(str(MODELS_DIR / "trained-eagle3.gguf"), num_pred_tokens=7),
            "draft model": lambda: spec.DraftModel(str(MODELS_DIR / "trained-draft-vlm.gguf"), num_pred_tokens=7)}
    with llama_cpp.Llama(TARGET, draft_model=make[draft](), **KW) as llm:
        out = llm(PROMPT, max_tokens=24, temperature=0.0)
    assert out["choices"][0]["text"] == greedy
    if draft != "prompt lookup":  # a fresh prompt may have nothing to look up
        assert out["speculative"]["drafted"] > 0 and out["speculative"]["accepted"] > 0


def test_an_mtp_draft_through_a_picture_gives_the_same_text():
    picture = [{"type": "image_url", "image_url": _png_data_uri(PICTURE)}, {"type": "text", "text": PROMPT}]
    messages = [{"role": "user", "content": picture}]
    handler = Qwen25VLChatHandler(clip_model_path=str(MODELS_DIR / "trained-qwen35-mtp-mmproj.gguf"))
    answers = []
    for draft in (None, spec.MTPDraft(num_pred_tokens=3)):
        with llama_cpp.Llama(QWEN35, chat_handler=handler, draft_model=draft, **KW) as llm:
            out = llm.create_chat_completion(messages=messages, max_tokens=24, temperature=0.0)
        answers.append((out["choices"][0]["message"]["content"], out["speculative"]))
    assert answers[0][0] == answers[1][0]
    assert answers[1][1]["drafted"] > 0 and answers[0][1]["drafted"] == 0


class _LookupDraft(spec.LlamaDraftModel):
    """A draft model of a user's own: llama-cpp-python's prompt lookup, written out, recording its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, /, **kwargs):
        self.calls.append(input_ids.copy())
        return spec.LlamaPromptLookupDecoding.find_candidate_pred_tokens(input_ids, 3, 7)


def test_a_draft_model_of_your_own_is_called_each_step_and_gives_the_same_text(greedy):
    draft = _LookupDraft()
    with llama_cpp.Llama(TARGET, draft_model=draft, **KW) as llm:
        out = llm(PROMPT, max_tokens=24, temperature=0.0)
        prompt_ids = llm.tokenize(PROMPT.encode())
    assert out["choices"][0]["text"] == greedy
    assert len(draft.calls) > 1 and out["speculative"]["drafted"] > 0
    first = draft.calls[0]  # the prompt and the first sampled token, as llama-cpp-python passes input_ids
    assert first.dtype == np.intc and first[:len(prompt_ids)].tolist() == prompt_ids and len(first) == len(prompt_ids) + 1


def test_a_draft_model_of_your_own_through_a_picture_its_garbage_cut_and_its_error_raised():
    picture = [{"type": "image_url", "image_url": _png_data_uri(PICTURE)}, {"type": "text", "text": PROMPT}]
    messages = [{"role": "user", "content": picture}]
    handler = Qwen25VLChatHandler(clip_model_path=str(MODELS_DIR / "trained-mmproj.gguf"))

    class Garbage(spec.LlamaDraftModel):
        def __call__(self, input_ids, /, **kwargs):
            return np.array([int(input_ids[-1]), -5, 10**9])  # a token, then no token ids: cut there

    answers = []
    for draft in (None, _LookupDraft(), Garbage()):
        with llama_cpp.Llama(TARGET, chat_handler=handler, draft_model=draft, **KW) as llm:
            out = llm.create_chat_completion(messages=messages, max_tokens=24, temperature=0.0)
        answers.append(out["choices"][0]["message"]["content"])
    assert answers[1] == answers[0] and answers[2] == answers[0]

    class Broken(spec.LlamaDraftModel):
        def __call__(self, input_ids, /, **kwargs):
            raise KeyError("the draft's own bug")

    with llama_cpp.Llama(TARGET, draft_model=Broken(), **KW) as llm:
        with pytest.raises(KeyError, match="the draft's own bug"):
            llm(PROMPT, max_tokens=8, temperature=0.0)
        with pytest.raises(KeyError):  # the engine is not left broken: the next call reaches the draft again
            llm(PROMPT, max_tokens=8, temperature=0.0)


def test_the_prompt_lookup_of_llama_cpp_python_is_kept():
    ids = np.array([1, 2, 3, 1, 2, 3, 1, 2, 3])
    assert spec.LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=2)(ids).tolist() == [1, 2]


# ----------------------------------------------------------------------------- token by token, and the state

def _tokens(llm, text=PROMPT):
    return llm.tokenize(text.encode(), add_bos=True, special=True)


def _first(llm, tokens, n=4, **kw):
    return list(itertools.islice(llm.generate(tokens, temp=0.0, **kw), n))


def test_eval_sample_and_generate_are_the_completions_greedy_tokens(llm, greedy):
    """eval then sample gives the completion's first token; generate continues from what eval decoded
    (decoding only the last token again), and a completion after it reuses the same cache."""
    tokens = _tokens(llm)
    llm.reset()
    llm.eval(tokens)
    assert llm.n_tokens == len(tokens) and llm.input_ids[: llm.n_tokens].tolist() == tokens
    first = llm.sample(temp=0.0, idx=len(tokens) - 1)
    out = _first(llm, tokens, 6)
    assert out[0] == first
    assert llm.detokenize(out).decode() == greedy[: len(llm.detokenize(out).decode())]
    assert llm.n_tokens == len(tokens) + len(out) - 1  # the last token read was not decoded, as there
    # tokens sent into the generator (a Python draft's guesses) are decoded with the pick, and each is
    # checked against the pick at its row: that needs every row's logits (logits_all), as there
    with llama_cpp.Llama(TARGET, logits_all=True, **KW) as every_row:
        gen = every_row.generate(tokens, temp=0.0)
        guess = [next(gen)] + out[1:3]  # (the pick, and the two greedy tokens after it)
        assert [gen.send(guess[1:])] + [next(gen)] == out[1:3]
        assert every_row.n_tokens == len(tokens) + 3  # both guesses held: nothing cut
        gen.close()
        kept = every_row.save_state().scores  # with logits_all a state keeps every decoded row's logits
        assert kept.shape == (every_row.n_tokens, every_row.n_vocab()) and np.isfinite(kept[-1]).all()
        with pytest.raises(IndexError, match="output rows"):
            llm.eval(tokens)
            g = llm.generate(tokens, temp=0.0)
            g.send(None), g.send([0])  # without logits_all the sent token's row has no logits
    # a completion reads back what the slot holds
    text = llm(PROMPT, max_tokens=8, temperature=0.0)["choices"][0]["text"]
    assert text == greedy[: len(text)] and llm.input_ids[: len(tokens)].tolist() == tokens
    with pytest.raises(ValueError, match="do not fit the context"):
        llm.eval([1] * (llm.n_ctx() + 1))
    with pytest.raises(ValueError, match="not in the vocabulary"):
        llm.reset()
        llm.eval([llm.n_vocab()])


def test_logits_processors_and_stopping_criteria_run_per_token(llm, greedy):
    """A completion with a logits_processor or stopping_criteria runs llama-cpp-python's token loop:
    an identity processor gives the engine's greedy text, a processor can force a token, stop strings
    and criteria end it, and its stream adds up to the same text."""
    identity = llama_cpp.LogitsProcessorList([lambda ids, logits: logits])
    out = llm(PROMPT, max_tokens=24, temperature=0.0, logits_processor=identity)
    assert out["choices"][0]["text"] == greedy and out["usage"]["completion_tokens"] == 24
    assert out["choices"][0]["finish_reason"] == "length"
    seen = []

    def force_x(ids, logits):
        seen.append(len(ids))
        logits[:] = -np.inf
        logits[ord("x")] = 0.0  # (this tiny vocabulary is bytes)
        return logits

    forced = llm(PROMPT, max_tokens=5, temperature=0.8, seed=3, logits_processor=[force_x])
    assert forced["choices"][0]["text"] == "xxxxx" and len(seen) == 5
    assert seen == sorted(seen) and seen[0] >= len(_tokens(llm))  # the tokens so far, growing
    stop = greedy[5:8]
    stopped = llm(PROMPT, max_tokens=24, temperature=0.0, stop=[stop], logits_processor=identity)
    assert stopped["choices"][0] == dict(text=greedy[: greedy.index(stop)], index=0, logprobs=None,
                                         finish_reason="stop")
    criteria = llama_cpp.StoppingCriteriaList([lambda ids, logits: len(ids) >= len(_tokens(llm)) + 3])
    short = llm(PROMPT, max_tokens=24, temperature=0.0, stopping_criteria=criteria)
    assert short["choices"][0]["finish_reason"] == "stop" and short["choices"][0]["text"] == greedy[:3]
    chunks = list(llm(PROMPT, max_tokens=24, temperature=0.0, stop=[stop], logits_processor=identity, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == greedy[: greedy.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    special = "<|im_start|>user\n" + PROMPT  # echo gives the prompt as written, special tokens too
    echoed = llm(special, max_tokens=4, temperature=0.0, echo=True, logits_processor=identity)["choices"][0]["text"]
    assert echoed.startswith(special) and len(echoed) > len(special)


def test_sample_reads_the_model_logits_after_a_hook_a_state_or_a_completion(llm):
    """A logits processor's edit is for its own pick only; after load_state or a completion, sample
    reads the last token's logits again (llama-cpp-python restores them, or left them there)."""
    tokens = _tokens(llm)
    llm.reset()
    llm.eval(tokens)
    first = llm.sample(temp=0.0)

    def ban_first(ids, logits):
        logits[first] = -np.inf
        return logits

    assert llm.sample(temp=0.0, logits_processor=[ban_first]) != first
    assert llm.sample(temp=0.0) == first  # the ban did not stay in the context's logits
    state = llm.save_state()
    llm(PROMPT + "pass", max_tokens=3, temperature=0.0)
    assert llm.sample(temp=0.0) is not None  # after a completion: its last token's logits
    llm.load_state(state)
    assert llm.sample(temp=0.0) == first


@pytest.mark.parametrize("path", [TARGET, QWEN35], ids=["transformer", "hybrid"])
def test_save_state_and_load_state_replay_a_seeded_draw(path):
    """llama-cpp-python's test_real_llama on a stand-in: after load_state the same seed chain draws the
    same numbers again, and a state loaded into another Llama continues as the first would."""
    grammar = llama_cpp.LlamaGrammar.from_string('root ::= "1" | "2" | "3" | "4" | "5" | "6" | "7" | "8" | "9"')
    with llama_cpp.Llama(path, **KW) as llm:
        assert llm._is_hybrid is (path == QWEN35) and llm._is_recurrent is False
        llm.set_seed(1337)
        state = llm.save_state()
        assert state.scores.shape == (0, llm.n_vocab())  # without logits_all there are none to keep

        def draw():
            return llm("Pick a number:", max_tokens=2, temperature=1.0, grammar=grammar)["choices"][0]["text"]

        draws = [draw() for _ in range(4)]
        llm.load_state(state)
        assert [draw() for _ in range(4)] == draws
        tokens = _tokens(llm)
        llm.reset()  # (eval decodes after the n_tokens already decoded)
        llm.eval(tokens)
        saved = llm.save_state()
        expected = _first(llm, tokens)
    with llama_cpp.Llama(path, **KW) as other:
        other.eval(_tokens(other, "something else entirely"))
        other.load_state(saved)
        assert other.n_tokens == len(tokens) and other.input_ids[: other.n_tokens].tolist() == tokens
        assert _first(other, tokens) == expected


def test_a_state_made_by_hand_loads_by_the_slots_own_draft_positions(greedy):
    """A LlamaState built from llama-cpp-python's fields alone (no ``saved``: tokens and a memory image)
    loads into a Llama whose DFlash draft lays out pictures by sequential positions, and keeps that mode."""
    draft = spec.DFlashDraft(str(MODELS_DIR / "trained-draft.gguf"), draft_positions="sequential")
    with llama_cpp.Llama(TARGET, draft_model=draft, **KW) as llm:
        tokens = _tokens(llm)
        llm.eval(tokens)
        full = llm.save_state()
        expected = _first(llm, tokens)
        by_hand = llama_cpp.LlamaState(input_ids=full.input_ids, scores=full.scores, n_tokens=full.n_tokens,
                                       llama_state=full.llama_state, llama_state_size=full.llama_state_size,
                                       seed=full.seed)
        llm.reset()
        llm.load_state(by_hand)
        assert llm.engine.sequences[0].positions.draft_positions == "sequential"
        assert llm.n_tokens == len(tokens) and _first(llm, tokens) == expected


def test_a_state_from_another_model_is_refused_and_leaves_the_llama_usable(llm, greedy):
    with llama_cpp.Llama(QWEN35, **KW) as other:
        other.eval(_tokens(other))
        foreign = other.save_state()
    with pytest.raises(Exception, match="(?i)memory|state|restore"):
        llm.load_state(foreign)
    assert llm.n_tokens == 0
    assert llm(PROMPT, max_tokens=24, temperature=0.0)["choices"][0]["text"] == greedy


def test_the_prompt_caches_start_a_completion_from_a_kept_state(tmp_path, greedy):
    """set_cache(LlamaRAMCache()) / LlamaDiskCache: each completion's state is kept under its tokens; a
    fresh Llama given the cache loads the state (through self.load_state) and answers the same."""
    for cache in (llama_cpp.LlamaRAMCache(), llama_cpp.LlamaDiskCache(str(tmp_path / "disk"))):
        with llama_cpp.Llama(TARGET, **KW) as writer:
            writer.set_cache(cache)
            assert writer(PROMPT, max_tokens=6, temperature=0.0)["choices"][0]["text"] == greedy[:6]
            assert _tokens(writer) in cache and cache.cache_size > 0
        with llama_cpp.Llama(TARGET, **KW) as reader:
            reader.set_cache(cache)
            loads = []
            real_load = reader.load_state
            reader.load_state = lambda state: (loads.append(state), real_load(state))[1]
            assert reader(PROMPT, max_tokens=6, temperature=0.0)["choices"][0]["text"] == greedy[:6]
            assert len(loads) == 1
    small = llama_cpp.LlamaRAMCache(capacity_bytes=1)
    with llama_cpp.Llama(TARGET, **KW) as llm:
        llm.set_cache(small)
        llm(PROMPT, max_tokens=2, temperature=0.0)
    assert small.cache_size == 0  # over its capacity: dropped


def test_a_drafting_llama_decodes_token_by_token_and_completes_as_before(greedy):
    """eval / generate on a Llama with a DFlash draft: the draft sees the rows (the engine's sequence),
    and the completion after it gives the same greedy text as without a draft."""
    with llama_cpp.Llama(TARGET, draft_model=spec.DFlashDraft(str(MODELS_DIR / "trained-draft.gguf")), **KW) as llm:
        tokens = _tokens(llm)
        text = llm.detokenize(_first(llm, tokens, 6)).decode()
        assert text == greedy[: len(text)]
        llm.reset()
        llm.eval(tokens)
        out = llm(PROMPT, max_tokens=24, temperature=0.0)
        assert out["choices"][0]["text"] == greedy and out["speculative"]["drafted"] > 0
        # the completion found what eval decoded in the slot: all of the prompt but its last token
        assert out["speculative"]["prompt_reused"] == len(tokens) - 1


def test_vocab_only_tokenizes_and_refuses_to_generate():
    from pyllama_spec.native_build.source import pinned_source

    spm = pinned_source().path / "models" / "ggml-vocab-llama-spm.gguf"
    if not spm.exists():
        pytest.skip(f"{spm} is not in the pinned source")
    with llama_cpp.Llama(str(spm), vocab_only=True, verbose=False) as vocab:
        assert vocab.tokenize(b"Hello World") == [1, 15043, 2787]
        assert vocab.detokenize([1, 15043, 2787]) == b"Hello World"
        assert vocab._ctx.ctx is not None and vocab.tokenizer().decode([15043]) == " Hello"
        with pytest.raises(ValueError, match="vocab_only=True"):
            vocab("Hello", max_tokens=2)
        with pytest.raises(ValueError, match="vocab_only=True"):
            vocab.eval([1, 15043])
    from pyllama_spec.llama_cpp.llama_tokenizer import LlamaTokenizer

    assert LlamaTokenizer.from_ggml_file(str(spm)).encode("Hello World") == [1, 15043, 2787]


def test_the_ctypes_layer_is_named_as_missing():
    import pyllama_spec.llama_cpp._internals as internals

    with pytest.raises(AttributeError, match="ctypes layer is not part of"):
        internals.LlamaModel  # noqa: B018
    with pytest.raises(AttributeError, match="raw ctypes bindings"):
        llama_cpp.llama_model_default_params  # noqa: B018


WEATHER_TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_with_a_logits_processor_runs_it_at_every_token(llm, stream):
    messages = [{"role": "user", "content": PROMPT}]
    plain = llm.create_chat_completion(messages=messages, max_tokens=12, temperature=0.0)["choices"][0]
    seen = []

    def record_each_call(ids, logits):
        seen.append(len(ids))
        return logits

    kw = dict(messages=messages, max_tokens=12, temperature=0.0, stream=stream,
              logits_processor=llama_cpp.LogitsProcessorList([record_each_call]))
    if stream:
        chunks = list(llm.create_chat_completion(**kw))
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    else:
        out = llm.create_chat_completion(**kw)
        text, finish = out["choices"][0]["message"]["content"], out["choices"][0]["finish_reason"]
        assert out["usage"]["completion_tokens"] == len(seen)
    assert text == plain["message"]["content"] and finish == plain["finish_reason"]  # an identity processor
    assert len(seen) >= 1 and seen == sorted(seen)  # called at each token, the ids growing


# ----------------------------------------------------------------------------- what is refused

def test_what_the_facade_cannot_do_is_refused_with_the_reason(llm, tmp_path):
    with pytest.raises(NotImplementedError, match="logits_processor in a chat with pictures, tools"):
        llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL],
                                   tool_choice="required",
                                   logits_processor=llama_cpp.LogitsProcessorList([lambda ids, logits: logits]))
    with pytest.raises(NotImplementedError, match="logprobs with logits_processor"):
        llm(PROMPT, logprobs=2, logits_processor=llama_cpp.LogitsProcessorList([lambda ids, logits: logits]))
    with pytest.raises(ValueError, match="chat_handler"):
        llm.create_chat_completion(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _png_data_uri(PICTURE)}}]}])

    with pytest.raises(TypeError, match="LlamaDraftModel"):
        llama_cpp.Llama(TARGET, draft_model=3, **KW)
    with pytest.raises(TypeError, match="n_kittens"):
        llama_cpp.Llama(TARGET, n_kittens=3, **KW)
    with pytest.raises(ValueError, match="type_k"):
        llama_cpp.Llama(TARGET, type_k=99, **KW)
    with pytest.raises(ValueError, match="Clip model path does not exist"):
        MTMDChatHandler(clip_model_path=str(tmp_path / "missing.gguf"))
    with pytest.raises(RuntimeError, match="embedding=True"):
        llm.create_embedding("hi")
    with pytest.raises(ValueError, match="pooling_type=7"):
        llama_cpp.Llama(TARGET, pooling_type=7, **KW)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llama_cpp.Llama(TARGET, rope_freq_base=5000.0, **KW).close()
    assert any("rope_freq_base" in str(w.message) for w in caught)


def test_embeddings_as_llama_cpp_python_gives_them(tiny_bert):
    """``embed`` and ``create_embedding`` on the tiny BERT: llama-cpp-python's shapes, its defaults (not
    normalised, truncated to n_batch), a list per token with pooling none; and a decoder's too."""
    small = dict(KW, n_ctx=64, n_batch=32, n_ubatch=32)
    with llama_cpp.Llama(str(tiny_bert), embedding=True, **small) as bert:
        one = bert.embed("Hello World")
        assert isinstance(one, list) and len(one) == bert.n_embd() and isinstance(one[0], float)
        assert bert.pooling_type() == 2  # cls, as the file declares
        both, count = bert.embed(["Hello World", "A different prompt"], return_count=True)
        np.testing.assert_allclose(both[0], one, atol=1e-6)
        assert count == len(bert.tokenize(b"Hello World")) + len(bert.tokenize(b"A different prompt"))
        assert abs(np.linalg.norm(bert.embed("Hello World", normalize=True)) - 1) < 1e-5
        assert abs(np.linalg.norm(one) - 1) > 1e-3  # not normalised by default
        assert len(bert.embed("hello " * 100)) == bert.n_embd()  # truncated to n_batch
        with pytest.raises(ValueError, match="exceed batch size of 32"):
            bert.embed("hello " * 100, truncate=False)
        response = bert.create_embedding(["a", "b"], model="m")
        assert response["object"] == "list" and response["model"] == "m"
        assert [d["index"] for d in response["data"]] == [0, 1] and response["data"][0]["object"] == "embedding"
        assert response["usage"]["prompt_tokens"] == response["usage"]["total_tokens"] == 6  # [CLS] x [SEP], twice
    with llama_cpp.Llama(str(tiny_bert), embedding=True, pooling_type=0, **small) as rows:
        per_token = rows.embed("hello hello hello")
        assert len(per_token) == 5 and len(per_token[0]) == rows.n_embd()
    with llama_cpp.Llama(TARGET, embedding=True, pooling_type=1, **KW) as decoder:
        vector = decoder.embed(PROMPT)
        assert len(vector) == decoder.n_embd()
        text = decoder(PROMPT, max_tokens=8, temperature=0.0)["choices"][0]["text"]  # it still generates
    with llama_cpp.Llama(TARGET, **KW) as plain:
        assert plain(PROMPT, max_tokens=8, temperature=0.0)["choices"][0]["text"] == text


def test_the_facade_is_documented():
    doc = (REPO_ROOT / "docs" / "llama_cpp.md").read_text()
    assert "from pyllama_spec import llama_cpp" in doc and "draft_model=" in doc


# ----------------------------------------------------------------------------- fill in the middle

def test_suffix_fills_in_the_middle_with_the_models_fim_tokens(tiny_fim):
    kw = dict(n_ctx=1024, n_threads=N_THREADS, verbose=False)
    with llama_cpp.Llama(str(tiny_fim.target), **kw) as llm:
        fim = llm._engine.model.fim_tokens
        pre, suf = llm.tokenize(b"def add(a, b):", add_bos=False), llm.tokenize(b"\n    return c", add_bos=False)
        bos = [llm.token_bos()] if llm._engine.model.add_bos else []
        laid_out = bos + [fim["pre"], *pre, fim["suf"], *suf, fim["mid"]]
        got = llm("def add(a, b):", suffix="\n    return c", max_tokens=8, temperature=0.0)
        assert got["choices"][0]["text"] == llm(laid_out, max_tokens=8, temperature=0.0)["choices"][0]["text"]
        assert got["usage"]["prompt_tokens"] == len(laid_out)
    with llama_cpp.Llama(str(tiny_fim.target), spm_infill=True, **kw) as llm:  # the suffix part first
        spm = bos + [fim["suf"], *suf, fim["pre"], *pre, fim["mid"]]
        got = llm("def add(a, b):", suffix="\n    return c", max_tokens=8, temperature=0.0)
        assert got["choices"][0]["text"] == llm(spm, max_tokens=8, temperature=0.0)["choices"][0]["text"]


def test_a_suffix_for_a_model_without_fim_tokens_follows_the_answer_as_in_llama_cpp_python(llm):
    plain = llm(PROMPT, max_tokens=6, temperature=0.0)["choices"][0]["text"]
    assert llm(PROMPT, suffix=" # end", max_tokens=6, temperature=0.0)["choices"][0]["text"] == plain + " # end"
    chunks = list(llm(PROMPT, suffix=" # end", max_tokens=6, temperature=0.0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain + " # end"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# ----------------------------------------------------------------------------- named chat formats
FORMATS_RECORD = REPO_ROOT / "bench" / "llama_cpp_python_chat_formats_0.3.36.json"


def test_named_chat_formats_render_what_llama_cpp_python_renders():
    """Every named format of llama-cpp-python 0.3.36 makes the same prompt, stop and added_special of the
    same conversations (recorded from the real package:
    python -m pyllama_spec.devtools.llama_cpp_python_formats --python VENV/bin/python --write FILE)."""
    from pyllama_spec.llama_cpp import llama_chat_format

    record = json.loads(FORMATS_RECORD.read_text())
    assert set(record["formats"]) <= set(llama_chat_format.CHAT_FORMATS) and len(record["formats"]) == 23
    for name, expected in record["formats"].items():
        formatter = llama_chat_format.get_chat_formatter(name)
        for messages, want in zip(record["conversations"], expected):
            got = formatter(messages=messages)
            assert {"prompt": got.prompt, "stop": got.stop, "added_special": got.added_special} == want, name


def test_a_json_schema_makes_the_grammar_llama_cpp_python_makes():
    record = json.loads(FORMATS_RECORD.read_text())
    for schema, grammar in zip(record["schemas"], record["grammars"]):
        assert llama_cpp.LlamaGrammar.from_json_schema(json.dumps(schema)).grammar == grammar, schema
    with pytest.raises(ValueError, match="at most 290 optional properties"):  # the cost check comes first
        llama_cpp.LlamaGrammar.from_json_schema({"type": "object", "properties": {
            f"p{i}": {"type": "string"} for i in range(20_000)}})
    with pytest.raises(ValueError, match="Fetching remote schemas is not allowed"):
        llama_cpp.LlamaGrammar.from_json_schema('{"$ref": "https://example.com/s.json"}')
    with pytest.raises(ValueError, match="IndexError"):  # the converter's own failure, as a GrammarError
        llama_cpp.LlamaGrammar.from_json_schema({"type": "string", "pattern": "^*$"})


def test_a_chat_format_answers_as_a_completion_of_the_prompt_it_renders():
    """chat_format="chatml": the prompt is the format's, completed with its stop strings, in the chat's
    shapes; a named tool's call is its arguments under the tool's schema grammar, as llama-cpp-python
    answers (compared with the real package on these requests: the same texts, bench/RESULTS.md)."""
    from pyllama_spec.llama_cpp.llama_chat_format import format_chatml

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    with llama_cpp.Llama(TARGET, chat_format="chatml", **KW) as chat_llm:
        prompt = format_chatml(messages=messages)
        plain = chat_llm.create_completion(chat_llm.tokenize(prompt.prompt.encode(), add_bos=True, special=True),
                                           temperature=0, max_tokens=24, stop=[prompt.stop])
        whole = chat_llm.create_chat_completion(messages=messages, temperature=0, max_tokens=24)
        choice = whole["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": plain["choices"][0]["text"]}
        assert whole["id"].startswith("chatcmpl-") and whole["object"] == "chat.completion"
        assert choice["finish_reason"] == plain["choices"][0]["finish_reason"] and whole["usage"] == plain["usage"]
        chunks = list(chat_llm.create_chat_completion(messages=messages, temperature=0, max_tokens=24, stream=True))
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == choice["message"]["content"]
        tool = {"type": "function", "function": {"name": "get", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
        called = chat_llm.create_chat_completion(messages=messages, temperature=0, max_tokens=24, tools=[tool],
                                                 tool_choice={"type": "function", "function": {"name": "get"}})
        call = called["choices"][0]["message"]["tool_calls"][0]
        assert called["choices"][0]["finish_reason"] == "tool_calls" and call["function"]["name"] == "get"
        assert call["function"]["arguments"].startswith('{"x"')
        streamed = list(chat_llm.create_chat_completion(
            messages=messages, temperature=0, max_tokens=24, tools=[tool], stream=True,
            tool_choice={"type": "function", "function": {"name": "get"}}))
        assert "".join(c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                       for c in streamed[1:-1]) == call["function"]["arguments"]
        assert streamed[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # a schema the converter fails on: any JSON instead, as llama-cpp-python falls back
        odd = chat_llm.create_chat_completion(messages=messages, temperature=0, max_tokens=8, response_format={
            "type": "json_object", "schema": {"type": "string", "pattern": "^*$"}})
        assert odd["choices"][0]["message"]["content"].lstrip().startswith(("{", "["))
        with pytest.raises(ValueError, match="Tool choice 'nope' not found"):
            chat_llm.create_chat_completion(messages=messages, tools=[tool],
                                            tool_choice={"type": "function", "function": {"name": "nope"}})


def test_chat_format_names_unknown_of_your_own_and_handlers(llm):
    from pyllama_spec.llama_cpp.llama_chat_format import (ChatFormatterResponse,
                                                          LlamaChatCompletionHandlerNotFoundException,
                                                          register_chat_format)

    with llama_cpp.Llama(TARGET, chat_format="no-such-format", **KW) as unknown:  # as llama-cpp-python: at chat
        with pytest.raises(LlamaChatCompletionHandlerNotFoundException, match="Invalid chat handler: no-such-format"):
            unknown.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    messages = [{"role": "user", "content": "def f("}]
    with llama_cpp.Llama(TARGET, chat_format="chat_template.default", **KW) as named:  # llama-cpp-python's name
        assert named.chat_format == "chat_template.default"  # for the GGUF's own template
        assert named.create_chat_completion(messages=messages, temperature=0, max_tokens=8)["choices"][0]["message"] \
            == llm.create_chat_completion(messages=messages, temperature=0, max_tokens=8)["choices"][0]["message"]
    with pytest.raises(ValueError, match="already registered"):
        register_chat_format("chatml")(lambda messages, **kwargs: None)

    @register_chat_format("test-plain")
    def plain(messages, **kwargs):
        return ChatFormatterResponse(prompt="".join(m["content"] for m in messages), stop="\n\n")

    try:
        with llama_cpp.Llama(TARGET, chat_format="test-plain", **KW) as mine:
            answer = mine.create_chat_completion(messages=[{"role": "user", "content": "def f("}], temperature=0,
                                                 max_tokens=8)
            assert answer["choices"][0]["message"]["content"] == mine("def f(", temperature=0, max_tokens=8,
                                                                      stop="\n\n")["choices"][0]["text"]
    finally:
        llama_cpp.llama_chat_format.CHAT_FORMATS.pop("test-plain")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llama_cpp.Llama(TARGET, chat_format="functionary-v2", **KW).close()
    assert any("model's own template" in str(w.message) for w in caught)


def test_from_pretrained_finds_the_file_as_llama_cpp_python_does(tmp_path, monkeypatch):
    """from_pretrained lists the repository through huggingface_hub, fetches the one file matching the
    glob (and additional_files), and loads it; here a stand-in huggingface_hub serves local files (nothing
    is downloaded on this machine). Without huggingface_hub, the ImportError llama-cpp-python raises."""
    import shutil
    import sys
    import types

    calls = []

    class HfFileSystem:
        def ls(self, repo_id, recursive=False):
            return [{"name": f"{repo_id}/{name}"} for name in ("README.md", "model-q8_0.gguf", "model-f16.gguf",
                                                                "shards/part-00002.gguf")]

    def hf_hub_download(repo_id, filename, subfolder=None, local_dir=None, local_dir_use_symlinks="auto",
                        cache_dir=None, local_files_only=False):
        calls.append((filename, subfolder, local_files_only))
        path = tmp_path / (subfolder or "") / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            shutil.copy(TARGET, path)
        return str(path)

    hub = types.ModuleType("huggingface_hub")
    hub.HfFileSystem, hub.hf_hub_download = HfFileSystem, hf_hub_download
    hub.utils = types.ModuleType("huggingface_hub.utils")
    hub.utils.validate_repo_id = lambda repo_id: None
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    monkeypatch.setitem(sys.modules, "huggingface_hub.utils", hub.utils)
    with llama_cpp.Llama.from_pretrained("someone/model-GGUF", "*q8_0.gguf", additional_files=["shards/*"],
                                         **KW) as model:
        assert model.model_path == str(tmp_path / "model-q8_0.gguf") and model.n_vocab() > 0
    assert calls == [("model-q8_0.gguf", None, False), ("part-00002.gguf", "shards", False),
                     ("model-q8_0.gguf", None, True)]
    with pytest.raises(ValueError, match="Multiple files found in someone/model-GGUF matching"):
        llama_cpp.Llama.from_pretrained("someone/model-GGUF", "*.gguf", **KW)
    with pytest.raises(ValueError, match="No file found in someone/model-GGUF that match"):
        llama_cpp.Llama.from_pretrained("someone/model-GGUF", "*q4*", **KW)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ImportError, match="requires the huggingface-hub package"):
        llama_cpp.Llama.from_pretrained("someone/model-GGUF", "*q8_0.gguf", **KW)
