"""Tree attention masks, position ids and best chains against brute force."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ancestors

import sssd
from sssd import _core


@st.composite
def trees(draw):
    n = draw(st.integers(0, 40))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    scores = [draw(st.floats(0, 1, width=32)) for _ in range(n)]
    return parents, scores


def _tree(parents, scores):
    parents = np.array(parents, dtype=np.int32)
    depths = np.zeros(len(parents), dtype=np.int32)
    for i, p in enumerate(parents):
        depths[i] = 1 if p < 0 else depths[p] + 1
    n = len(parents)
    return sssd.DraftTree(
        np.arange(n),
        parents,
        depths,
        np.array(scores, np.float32),
        np.zeros(n, np.uint8),
        np.full(n, np.nan, np.float32),
    )


@settings(max_examples=200, deadline=None)
@given(t=trees())
def test_mask_is_exactly_the_ancestors(t):
    parents, scores = t
    tree = _tree(parents, scores)
    m = tree.attention_mask(include_root=False)
    for i in range(len(parents)):
        assert set(np.flatnonzero(m[i])) == ancestors(parents, i)
    full = tree.attention_mask()
    assert full[:, 0].all() and full[0].sum() == 1
    np.testing.assert_array_equal(full[1:, 1:], m)


@settings(max_examples=100, deadline=None)
@given(t=trees(), root=st.integers(0, 10_000))
def test_positions_are_root_plus_depth(t, root):
    parents, scores = t
    tree = _tree(parents, scores)
    pos = tree.position_ids(root)
    assert pos[0] == root
    for i in range(len(parents)):
        assert pos[i + 1] == root + len(ancestors(parents, i))


@settings(max_examples=200, deadline=None)
@given(t=trees())
def test_best_chain_maximises_the_score_sum(t):
    parents, scores = t
    tree = _tree(parents, scores)
    chain = tree.best_chain().tolist()
    if not parents:
        assert chain == []
        return
    # a root-to-node path, starting at a child of the root
    assert parents[chain[0]] == -1
    assert all(parents[b] == a for a, b in zip(chain, chain[1:]))
    is_parent = {p for p in parents if p >= 0}
    assert chain[-1] not in is_parent  # scores are >= 0: the best chain runs down to a leaf
    best = max(sum(scores[j] for j in ancestors(parents, i)) for i in range(len(parents)))
    assert np.isclose(sum(scores[j] for j in chain), best, rtol=1e-6)


def test_batch_best_chains_match_per_tree():
    rng = np.random.default_rng(0)
    ts = []
    for _ in range(10):
        n = int(rng.integers(0, 15))
        ts.append(_tree([int(rng.integers(-1, i)) if i else -1 for i in range(n)], rng.random(n).tolist()))
    batch = sssd.tree.concat(ts)
    off, nodes = batch.best_chains()
    for b, t in enumerate(ts):
        assert nodes[off[b] : off[b + 1]].tolist() == t.best_chain().tolist()


def test_paths_and_formatting():
    t = _tree([-1, 0, 0, 2], [0.9, 0.5, 0.8, 0.7])
    assert t.path(3) == [0, 2, 3]
    assert sorted(t.leaves().tolist()) == [1, 3]
    assert "d= 3" in t.format()


def test_best_chains_checks_every_offset_before_reading():
    parents = np.array([-1, 0, -1, 0, 1], dtype=np.int32)  # trees [-1, 0] and [-1, 0, 1]
    scores = np.ones(5, dtype=np.float32)
    off, nodes = _core.best_chains(np.array([0, 2, 5], dtype=np.int64), parents, scores)
    assert off.tolist() == [0, 2, 5] and nodes.tolist() == [0, 1, 0, 1, 2]
    # A middle offset beyond the arrays (or below the previous one) used to be
    # read before the next offset disagreed: an out-of-bounds read.
    for bad in ([0, 10**6, 5], [0, 7, 5], [0, -3, 5], [0, 3, 2, 5], [1, 5], [0, 4], [0, 6]):
        with pytest.raises(ValueError, match="offsets"):
            _core.best_chains(np.array(bad, dtype=np.int64), parents, scores)
    with pytest.raises(ValueError, match=r"tree 1: parent\[0\] = 0 must be -1 or an earlier node of the same tree"):
        _core.best_chains(np.array([0, 3, 5], dtype=np.int64), parents, scores)  # tree 1's first node has a parent
    with pytest.raises(ValueError, match="len"):
        _core.best_chains(np.array([0, 5], dtype=np.int64), parents, scores[:4])
    with pytest.raises(ValueError, match="offsets"):
        _core.best_chains(np.zeros(0, dtype=np.int64), parents, scores)
