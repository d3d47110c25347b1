"""Draft trees: several candidates per draft position, verified by the target in one decode.

A DFlash block gives the draft's distribution at every position of the block at once
(q_1 .. q_n, each conditioned on the context, not on the tokens drafted before it). A
chain verifies only the argmax path; at temperature > 0 the target's sample leaves that
path early. A tree keeps the ``budget`` likeliest token paths under the draft (best-first
by the product of q along the path, ``build_tree``), and the target decodes all of its
nodes in one batch, each attending only to its ancestors (tree attention through
sequence ids, see ``TreeSeqs``). Verification then walks down from the root with the
target's own sampler (``walk``): sample at the node, move to the child holding that token,
stop when no child does. Every token is the target's sample at its true prefix, drawn in
the same order as without a draft, so the output is the target-only output token for token
(for a seed), like llama.cpp's chain rule, while far more drafts survive.

Pure numpy and Python; the batch and memory calls live in generation.py.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Callable

import numpy as np

#: Candidates per node considered when growing a tree (a node rarely needs more children).
TREE_TOP_K = 8


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """Node 0 is the root (``id_last``, at depth 0); every other node is a drafted token.

    ``parent[i] < i`` (parents come first), ``depth[i] = depth[parent[i]] + 1``; the nodes
    are decoded in this order, node i at target position ``pos_next + depth[i]``.
    """

    tokens: np.ndarray  # int32 [n_nodes]
    parent: np.ndarray  # int32 [n_nodes]; -1 for the root
    depth: np.ndarray  # int32 [n_nodes]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_drafted(self) -> int:
        return len(self.tokens) - 1

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    def children(self) -> list[dict[int, int]]:
        """For every node, its children by token."""
        out: list[dict[int, int]] = [{} for _ in range(len(self))]
        for i in range(1, len(self)):
            out[int(self.parent[i])][int(self.tokens[i])] = i
        return out

    def path(self, node: int) -> list[int]:
        """The nodes from the root's first child down to ``node`` (empty for the root)."""
        out = []
        while node > 0:
            out.append(node)
            node = int(self.parent[node])
        return out[::-1]


def build_tree(id_last: int, logits: np.ndarray, budget: int, *, top_k: int = TREE_TOP_K) -> DraftTree:
    """The ``budget`` likeliest drafted paths under the draft's block logits [depth, n_vocab].

    Best-first: a node's score is the sum of log q along its path (q: the draft's own
    distribution at each position); the tree holds the ``budget`` best nodes whose parents
    are in it (a child never scores above its parent, so these are simply the best
    ``budget`` nodes). Each node is offered the ``top_k`` likeliest tokens of its depth.
    """
    logits = np.asarray(logits, dtype=np.float64)
    n_depth = len(logits)
    tokens, parent, depth = [int(id_last)], [-1], [0]
    if n_depth == 0 or budget <= 0:
        return _tree(tokens, parent, depth)
    logq = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    k = max(1, min(top_k, budget, logits.shape[1]))
    top = np.argpartition(-logq, k - 1, axis=1)[:, :k]
    top = np.take_along_axis(top, np.argsort(-np.take_along_axis(logq, top, axis=1), axis=1), axis=1)
    # heap entries: (-score, tie-break counter, parent node, depth of the child, token)
    heap: list[tuple[float, int, int, int, int]] = []
    counter = 0

    def offer(node: int, score: float, d: int) -> None:
        nonlocal counter
        if d >= n_depth:
            return
        for tok in top[d].tolist():
            heapq.heappush(heap, (-(score + logq[d, tok]), counter, node, d, tok))
            counter += 1

    offer(0, 0.0, 0)
    while heap and len(tokens) <= budget:
        neg, _, par, d, tok = heapq.heappop(heap)
        tokens.append(tok)
        parent.append(par)
        depth.append(d + 1)
        offer(len(tokens) - 1, -neg, d + 1)
    return _tree(tokens, parent, depth)


def chain_tree(id_last: int, draft: list[int]) -> DraftTree:
    """A chain as a tree (one child per node): what the tree code does with a plain draft."""
    n = len(draft)
    return _tree([int(id_last), *map(int, draft)], [-1, *range(n)], list(range(n + 1)))


def _tree(tokens, parent, depth) -> DraftTree:
    return DraftTree(np.asarray(tokens, dtype=np.int32), np.asarray(parent, dtype=np.int32),
                     np.asarray(depth, dtype=np.int32))


@dataclasses.dataclass(frozen=True)
class TreeSeqs:
    """Sequence ids that give a tree's nodes tree attention in one decode.

    Every leaf gets its own sequence id (``first_seq``, ``first_seq + 1``, ...), and every
    node carries the ids of the leaves below it. llama.cpp lets a row attend to the cache
    cells that carry the row's first (smallest) sequence id at positions up to its own: for
    a node that is exactly its ancestors and itself (the other nodes on that leaf's path
    are deeper). The prompt is copied to every leaf sequence before the decode, and the
    leaf sequences are dropped after it.
    """

    leaf_seqs: list[int]  # one per leaf, in node order
    node_seqs: list[list[int]]  # per node: ascending sequence ids (the first is what it attends by)

    @classmethod
    def assign(cls, tree: DraftTree, first_seq: int) -> "TreeSeqs":
        n = len(tree)
        has_child = np.zeros(n, dtype=bool)
        has_child[tree.parent[1:]] = True
        leaves = np.flatnonzero(~has_child)
        seq_of_leaf = {int(node): first_seq + j for j, node in enumerate(leaves)}
        node_seqs: list[list[int]] = [[] for _ in range(n)]
        for node in range(n - 1, -1, -1):  # children before parents (parent[i] < i)
            if node in seq_of_leaf:
                node_seqs[node].append(seq_of_leaf[node])
            node_seqs[node].sort()
            if node > 0:
                node_seqs[int(tree.parent[node])].extend(node_seqs[node])
        return cls([seq_of_leaf[int(v)] for v in leaves], node_seqs)

    def seq_through(self, node: int) -> int:
        """A sequence id whose cells are the root's path down to (and past) ``node``."""
        return self.node_seqs[node][0]


def walk(tree: DraftTree, sample_at: Callable[[int], int]) -> tuple[list[int], int]:
    """Verify a tree: from the root, sample the target at the node and follow the child holding
    that token, until no child does. ``sample_at(node)`` samples the target's output row of
    ``node``. Returns (the accepted nodes, root excluded; the target's token after the last)."""
    children = tree.children()
    node, accepted = 0, []
    while True:
        tok = sample_at(node)
        nxt = children[node].get(tok)
        if nxt is None:
            return accepted, tok
        accepted.append(nxt)
        node = nxt
