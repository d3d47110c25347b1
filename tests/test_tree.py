"""Draft trees (tree.py): many candidates per draft position, verified in one target decode.

* the pure parts: the tree holds the best paths under the draft (against brute force), every
  node's sequence ids let it attend to exactly its ancestors, the walk follows the samples;
* on the embedded trained pair, as users call it: the tokens equal target-only tokens for a seed
  (greedy and sampled, text and after an image, across turns that reuse the cache), more drafts
  are accepted than with a chain, and after every step the cache holds the sequence only;
* what it cannot do is refused with a clear error, and a failed tree step leaves an engine
  that works.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import N_THREADS, TINY_ENGINE

import pyllama_spec as ps
from pyllama_spec.bindings.context import Context
from pyllama_spec.devtools.tiny import draw_demo_image
from pyllama_spec.errors import DecodeError
from pyllama_spec.speculative.tree import DraftTree, TreeSeqs, build_tree, chain_tree, walk

PROMPT = ps.embedded.PROMPT


# ----------------------------------------------------------------------------- pure


def _paths(tree: DraftTree) -> dict[tuple[int, ...], int]:
    return {tuple(int(tree.tokens[i]) for i in tree.path(n)): n for n in range(1, len(tree))}


def test_build_tree_keeps_the_best_paths_under_the_draft():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 6)) * 2.0
    logq = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    # every path of length 1..4 over the 3 likeliest tokens of each depth, by its score
    top = [np.argsort(-row)[:3] for row in logq]
    every = {}
    for d in range(1, 5):
        for path in itertools.product(*[t.tolist() for t in top[:d]]):
            every[path] = sum(logq[i, t] for i, t in enumerate(path))
    for budget in (1, 5, 12, 30):
        tree = build_tree(7, logits, budget, top_k=3)
        assert tree.tokens[0] == 7 and tree.parent[0] == -1 and tree.n_drafted == budget
        assert all(tree.parent[i] < i and tree.depth[i] == tree.depth[tree.parent[i]] + 1 for i in range(1, len(tree)))
        got = set(_paths(tree))
        best = sorted(every, key=every.get, reverse=True)[:budget]
        assert sorted(every[p] for p in got) == pytest.approx(sorted(every[p] for p in best))
    # a chain is a tree with one child per node
    chain = chain_tree(3, [4, 5, 6])
    assert chain.parent.tolist() == [-1, 0, 1, 2] and chain.depth.tolist() == [0, 1, 2, 3]


def test_tree_seqs_give_each_node_its_ancestors_only():
    rng = np.random.default_rng(1)
    for budget in (1, 4, 9, 31):
        tree = build_tree(0, rng.normal(size=(5, 20)), budget)
        seqs = TreeSeqs.assign(tree, first_seq=1)
        assert sorted(seqs.leaf_seqs) == list(range(1, len(seqs.leaf_seqs) + 1))
        for node in range(len(tree)):
            ids = seqs.node_seqs[node]
            assert ids == sorted(ids) and ids
            # llama.cpp's rule: a row sees the cells holding its first sequence id at depths <= its own
            seen = {j for j in range(len(tree)) if ids[0] in seqs.node_seqs[j] and tree.depth[j] <= tree.depth[node]}
            assert seen == {0, *tree.path(node)}
        # the sequence through a node covers its path (what the accepted path is kept by)
        for node in range(1, len(tree)):
            s = seqs.seq_through(node)
            assert {j for j in range(len(tree)) if s in seqs.node_seqs[j] and tree.depth[j] <= tree.depth[node]} \
                == {0, *tree.path(node)}


def test_walk_follows_the_target_samples_down_the_tree():
    #     root(9) -> 1 -> 3
    #             -> 2 -> 4 -> 5
    tree = DraftTree(np.array([9, 1, 2, 3, 4, 5]), np.array([-1, 0, 0, 1, 2, 4]), np.array([0, 1, 1, 2, 2, 3]))
    samples = {0: 2, 2: 4, 4: 5, 5: 8}
    seen = []
    nodes, last = walk(tree, lambda n: (seen.append(n), samples[n])[1])
    assert nodes == [2, 4, 5] and last == 8 and seen == [0, 2, 4, 5]
    nodes, last = walk(tree, lambda n: 7)  # the first sample is on no branch
    assert nodes == [] and last == 7


# ----------------------------------------------------------------------------- on the trained pair


@pytest.fixture(scope="module")
def engines():
    m = ps.embedded_models()
    kw = dict(mmproj=m.mmproj, draft=m.draft, n_ctx=2048, **TINY_ENGINE, draft_max=15)
    with ps.load(m.target, **kw) as chain, ps.load(m.target, draft_tree=32, **kw) as tree:
        yield chain, tree


def _clean(engine) -> None:
    """After a generation the cache holds the sequence's rows only: no tree branch is left."""
    mem = engine.ctx.memory
    assert mem.pos_max(0) == engine.positions.pos_next - 1
    assert all(mem.pos_max(s) == -1 for s in range(1, engine.config.draft_tree + 1))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tree_gives_target_only_tokens_and_accepts_more_than_a_chain(engines, temperature):
    chain, tree = engines
    mal_chain, mal_tree = [], []
    for seed in range(4):
        kw = dict(max_tokens=64, temperature=temperature, seed=seed, cache_prompt=False)
        plain = chain.generate(PROMPT, draft_max=0, **kw)
        c = chain.generate(PROMPT, draft_max=7, **kw)
        t = tree.generate(PROMPT, **kw)
        assert t.tokens == plain.tokens == c.tokens
        _clean(tree)
        assert t.stats.drafted > 0
        assert len(t.stats.per_position_acceptance) <= 15  # by depth, not by node
        mal_chain.append(1 + c.stats.accepted / c.stats.target_steps)
        mal_tree.append(1 + t.stats.accepted / t.stats.target_steps)
    assert np.mean(mal_tree) > np.mean(mal_chain) * (1.1 if temperature else 1.0)


def test_tree_after_an_image_and_across_turns(engines):
    chain, tree = engines
    image = draw_demo_image(672)  # 576 rows over 24 positions: the tree starts at pos_next, not at a row count
    first = ps.MEDIA_MARKER + "\n" + PROMPT
    for prompt in (first, first + "        return 'Counter(%r)' % self.name\n"):  # the second reuses the cache
        kw = dict(images=[image], max_tokens=48, temperature=0.8, seed=3)
        plain = chain.generate(prompt, draft_max=0, cache_prompt=False, **kw)
        t = tree.generate(prompt, **kw)
        assert t.tokens == plain.tokens
        _clean(tree)
    assert t.stats.prompt_reused > 576
    assert t.stats.accepted > 0


def test_per_request_tree_size_and_a_chain_on_the_same_engine(engines):
    chain, tree = engines
    plain = chain.generate(PROMPT, max_tokens=32, temperature=0.8, seed=5, draft_max=0).tokens
    for n in (0, 1, 8):
        r = tree.generate(PROMPT, max_tokens=32, temperature=0.8, seed=5, draft_tree=n)
        assert r.tokens == plain
        assert r.stats.drafted <= r.stats.target_steps * max(n, 15)
    with pytest.raises(ValueError, match="draft_tree must be an integer from 0 to the engine's draft_tree"):
        tree.generate(PROMPT, max_tokens=4, draft_tree=33)
    with pytest.raises(ValueError, match="rejection sampling over a tree"):
        tree.generate(PROMPT, max_tokens=4, temperature=0.8, verify="rejection")
    with pytest.raises(ValueError, match="draft_tree must be an integer from 0"):
        chain.generate(PROMPT, max_tokens=4, draft_tree=4)  # loaded without trees


def test_two_threads_sharing_a_tree_engine_each_get_target_only_tokens(engines):
    """One engine, two threads generating at once (the one slot runs them one after the other):
    each thread's answer is its target-only answer, and no branch is left in the cache."""
    import threading

    chain, tree = engines
    prompts = [PROMPT, "def add(a, b):\n"]
    kw = dict(max_tokens=40, temperature=0.8, cache_prompt=False)
    expected = [chain.generate(p, draft_max=0, seed=i, **kw).tokens for i, p in enumerate(prompts)]
    got, errors = [None, None], []

    def run(i):
        try:
            got[i] = tree.generate(prompts[i], seed=i, **kw).tokens
        except BaseException as e:  # what the thread saw, for the assertion below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and got == expected
    _clean(tree)


def test_a_failed_tree_decode_leaves_a_working_engine(engines, monkeypatch):
    chain, tree = engines
    expected = chain.generate(PROMPT, max_tokens=24, draft_max=0).tokens
    real = Context.decode
    calls = {"n": 0}

    def failing(self, batch):
        if self is tree.ctx and batch.n_rows > 1 and self.memory.pos_max(1) >= 0:  # a tree batch
            calls["n"] += 1
            if calls["n"] == 2:
                raise DecodeError("llama_process(DECODE)", 1, role="target", n_rows=batch.n_rows)
        return real(self, batch)

    monkeypatch.setattr(Context, "decode", failing)
    with pytest.raises(DecodeError):
        tree.generate(PROMPT, max_tokens=24)
    monkeypatch.setattr(Context, "decode", real)
    assert tree.generate(PROMPT, max_tokens=24).tokens == expected
    _clean(tree)


def test_what_a_tree_cannot_do_is_refused_before_loading(tmp_path):
    m = ps.embedded_models()
    cases = [
        (dict(spec_type="ngram-simple"), "needs a DFlash draft"),
        (dict(draft=m.draft, n_parallel=2), "one sequence"),
        (dict(draft=m.draft, draft_max="auto"), "fixed draft_max"),
        (dict(draft=m.draft, verify="rejection"), "match"),
        (dict(draft=m.draft, draft_tree=256), "from 0 to 255"),
        (dict(draft=m.draft, draft_tree=64, n_batch=64, n_ubatch=64), "needs n_batch >= 65"),
    ]
    for kwargs, message in cases:
        tree = kwargs.pop("draft_tree", 8)
        with pytest.raises(ValueError, match=message):
            ps.load(m.target, draft_tree=tree, n_threads=N_THREADS, **kwargs)
