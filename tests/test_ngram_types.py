"""llama.cpp's n-gram speculative types (ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache) and
comma lists of types: the same drafts as llama-server on the same file, lossless through pictures
and on every slot, and their own rules (a map cleaned up after a shorter prompt, ngram-mod's reset
after poor drafts, a list's priority order)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import LLAMA_SERVER, needs_llama_server

import pyllama_spec as ps
from pyllama_spec.devtools.servers import running_server
from pyllama_spec.drafters import DraftRequest, Proposal
from pyllama_spec.drafters.chain import ChainDrafter
from pyllama_spec.drafters.ngram_cache import NGRAM_STATIC, NgramCache
from pyllama_spec.drafters.ngram_map import NgramMap
from pyllama_spec.drafters.ngram_mod import NgramModDrafter
from pyllama_spec.embedded import embedded_models

#: Code the embedded pair continues with long repetitions: every type drafts on them.
PROMPTS = ("class Stack:\n    def __init__(self):\n        self.items = []\n", "def main():\n",
           "import os\nimport sys\n\ndef f(x):\n    return x\n\ndef g(x):\n    return x\n\n")
TYPES = ("ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "ngram-mod,ngram-map-k", "ngram-cache,ngram-mod")


@pytest.fixture(scope="module")
def pair():
    return embedded_models()


@pytest.fixture(scope="module")
def static_cache(pair, tmp_path_factory) -> Path:
    """A static n-gram cache (-lcs) as llama.cpp's llama-lookup-create makes one (2-grams of a
    corpus): here the target's own greedy answers to other prompts."""
    tokens = []
    with ps.load(pair.target, spec_type="none", n_ctx=4096, n_threads=2) as e:
        for prompt in ("class Queue:\n", "def parse(text):\n", "for i in range(10):\n"):
            tokens += e.generate(prompt, max_tokens=300, temperature=0).tokens
    cache = NgramCache()
    cache.update(tokens, len(tokens), NGRAM_STATIC, NGRAM_STATIC)
    path = tmp_path_factory.mktemp("lookup") / "static.lcs"
    cache.save(path)
    return path


# --------------------------------------------------------------------------- llama-server's drafts

def _answers(url: str) -> list[tuple[str, int, int]]:
    """Each prompt's text and (drafted, accepted), one after another on one slot (the cache reused)."""
    from serving import http as post

    out = []
    for prompt in PROMPTS:
        status, body = post(url, "/completion", {"prompt": prompt, "n_predict": 400, "temperature": 0})
        assert status == 200, body
        out.append((body["content"], body["timings"]["draft_n"], body["timings"]["draft_n_accepted"]))
    return out


@needs_llama_server
@pytest.mark.parametrize("spec_type", TYPES)
def test_the_same_drafts_as_llama_server_on_the_same_file(spec_type, pair, static_cache):
    from serving import LocalServer

    from pyllama_spec.server import ServerSettings

    lcs = ["-lcs", str(static_cache)] if "ngram-cache" in spec_type else []
    args = ["-m", str(pair.target), "--spec-type", spec_type, "-c", "4096", "-np", "1", "-t", "2", *lcs]
    with running_server([str(LLAMA_SERVER), *args, "-fa", "off", "--no-warmup"]) as url:
        theirs = _answers(url)
    ngram = {"lookup_cache_static": str(static_cache)} if lcs else {}
    with ps.load(pair.target, spec_type=spec_type, n_ctx=4096, n_threads=2, ngram=ngram) as engine, \
            LocalServer(engine, ServerSettings()) as ours:
        mine = _answers(ours.url)
    assert mine == theirs  # the text, and every draft's length and acceptance summed
    assert sum(d for _, d, _ in mine) > 200 and sum(a for _, _, a in mine) > 100


@needs_llama_server
@pytest.mark.parametrize(("spec_type", "draft", "draft_max"), [
    ("ngram-mod,draft-simple", "trained-draft-vlm.gguf", 5),
    ("ngram-map-k,draft-dflash", "trained-draft.gguf", 7),
    ("ngram-map-k4v,draft-eagle3", "trained-eagle3.gguf", 5),
])
def test_a_list_with_a_draft_type_drafts_what_llama_servers_does(spec_type, draft, draft_max, pair):
    """An n-gram type first, then the draft file's type when it finds nothing (llama.cpp's priority
    order): the same text, drafts and acceptance as llama-server's on the same files."""
    from serving import LocalServer

    from pyllama_spec.embedded import MODELS_DIR
    from pyllama_spec.server import ServerSettings

    args = ["-m", str(pair.target), "-md", str(MODELS_DIR / draft), "--spec-type", spec_type, "--spec-draft-n-max",
            str(draft_max), "-c", "4096", "-np", "1", "-t", "2"]
    with running_server([str(LLAMA_SERVER), *args, "-fa", "off", "--no-warmup"]) as url:
        theirs = _answers(url)
    with ps.load(pair.target, draft=MODELS_DIR / draft, spec_type=spec_type, draft_max=draft_max, n_ctx=4096,
                 n_threads=2) as engine, LocalServer(engine, ServerSettings()) as ours:
        mine = _answers(ours.url)
    assert mine == theirs
    assert sum(a for _, _, a in mine) > 300


# --------------------------------------------------------------------------- lossless

@pytest.mark.parametrize("spec_type", [*TYPES, "ngram-map-k4v,draft-dflash"])
def test_lossless_after_a_picture_on_two_slots_at_once(spec_type, pair):
    from pyllama_spec.embedded import draw_demo_image

    picture = draw_demo_image(224)
    jobs = [(f"Here: {ps.MEDIA_MARKER} {p}", [picture]) for p in PROMPTS[:2]] + [(PROMPTS[2], [])]
    with ps.load(pair.target, mmproj=pair.mmproj, spec_type="none", n_ctx=4096, n_threads=2) as plain:
        expected = [plain.generate(p, images=im, max_tokens=160, temperature=0).tokens for p, im in jobs]
    draft = pair.draft if "draft-" in spec_type else None
    with ps.load(pair.target, mmproj=pair.mmproj, draft=draft, spec_type=spec_type, n_ctx=4096, n_threads=2,
                 n_parallel=2) as spec:
        handles = [spec.submit(p, images=im, max_tokens=160, temperature=0) for p, im in jobs]
        results = [h.result() for h in handles]
    assert [r.tokens for r in results] == expected
    assert sum(r.stats.accepted for r in results) > 0


def test_a_bad_lookup_cache_file_is_refused_at_load_naming_it(pair, tmp_path):
    bad = tmp_path / "bad.lcs"
    bad.write_bytes(b"\x01\x00\x00\x00" * 5)  # an n-gram and a count of 1 pair, then nothing
    with pytest.raises(ValueError, match="bad.lcs"):
        ps.load(pair.target, spec_type="ngram-cache", ngram={"lookup_cache_static": str(bad)}, n_threads=2)
    with pytest.raises(ValueError, match="missing.lcs"):
        ps.load(pair.target, spec_type="ngram-cache", ngram={"lookup_cache_dynamic": str(tmp_path / "missing.lcs")},
                n_threads=2)


# --------------------------------------------------------------------------- their own rules

def test_map_k_drafts_what_followed_shortened_to_what_was_accepted_and_forgets_past_a_shorter_prompt():
    m = NgramMap(size_key=2, size_value=2, key_only=True, min_hits=1)
    history = np.array([5, 1, 2, 3, 4, 8, 6, 1, 2], dtype=np.int32)
    m.begin(history)
    assert m.draft(history, 3) == [4, 8]  # the key [2, 3] (id_last 3) at 2: the two tokens after it
    assert m.key_map.any() and m.keys[0].idx == 2
    m.accept(1)
    assert m.draft(history, 3) == [4]  # as long as the target took of the last draft from that key
    m.begin(history[:3])  # a new, shorter prompt: what was indexed past it goes
    assert m.keys == [] and not m.key_map.any()


def test_ngram_mod_resets_its_table_after_five_poor_drafts():
    d = NgramModDrafter(n_match=2, n_min=1, n_max=4, table_size=1024)
    d.table.add_all(np.array([1, 2, 3, 4, 5, 6], dtype=np.int32), 0, 4)
    assert d.table.used == 4
    info = d._info(0)
    for i in range(5):
        info.n_draft_last = 4
        d.accept(0, 0)
        assert (d.table.used == 0) == (i == 4)


class _Fixed:
    def __init__(self, name, tokens, n_max=8):
        self.name, self.tokens, self.n_max, self.n_min, self.n_max_limit, self.limit_reason = \
            name, tokens, n_max, 0, n_max, ""
        self.accepted, self.asked = [], []

    def process(self, decode): pass
    def begin(self, seq_id): pass
    def forget(self, seq_id, pos, draft_pos): pass
    def close(self): pass

    def draft(self, requests):
        self.asked += [r.n_max for r in requests]
        return [Proposal(self.tokens.get(r.seq_id, [])[:r.n_max]) for r in requests]

    def accept(self, seq_id, n_accepted):
        self.accepted.append((seq_id, n_accepted))


def test_a_list_asks_in_order_each_drafter_up_to_its_own_length_and_tells_the_one_verified():
    first, second = _Fixed("ngram", {0: [1, 2, 3]}, n_max=64), _Fixed("draft", {0: [9], 1: [4, 5, 6, 7]}, n_max=3)
    chain = ChainDrafter([first, second])
    assert chain.n_max == 64
    made = chain.draft([DraftRequest(0, 0, 0, 0, 64), DraftRequest(1, 0, 0, 0, 64)])
    assert [p.tokens for p in made] == [[1, 2, 3], [4, 5, 6]]  # seq 1: the draft model's, at its own length
    assert second.asked == [3]  # only seq 1 reached it
    chain.accept(0, 2)
    chain.accept(1, 1)
    assert first.accepted == [(0, 2)] and second.accepted == [(1, 1)]
