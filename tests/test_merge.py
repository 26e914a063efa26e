"""Algorithm 1 (the priority-queue merge) against a brute-force replica."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import merge

import sssd
from sssd import _core


@st.composite
def source_trees(draw):
    """A list of random weighted trees as parent-pointer arrays (parents first)."""
    trees = []
    for _ in range(draw(st.integers(1, 4))):
        tokens, parents, weights = [], [], []
        seen = set()
        for _ in range(draw(st.integers(0, 25))):
            p = draw(st.integers(-1, len(tokens) - 1))
            tok = draw(st.integers(0, 5))
            if (p, tok) in seen:
                continue  # (parent, token) is unique in real trees
            seen.add((p, tok))
            tokens.append(tok)
            parents.append(p)
            weights.append(float(draw(st.integers(1, 20))))
        trees.append(
            {
                "tokens": np.array(tokens, dtype=np.uint32),
                "parents": np.array(parents, dtype=np.int32),
                "weights": np.array(weights, dtype=np.float64),
                "total": float(draw(st.integers(1, 40))),
                "source": draw(st.integers(0, 2)),
                "match_len": draw(st.integers(0, 4)),
                "max_depth": draw(st.integers(1, 6)),
            }
        )
    return trees


def _paths(tree):
    out, prefix = {}, []
    for t, p, w in zip(tree["tokens"], tree["parents"], tree["weights"]):
        path = (prefix[p] if p >= 0 else ()) + (int(t),)
        prefix.append(path)
        out[path] = float(np.float32(w))  # the core stores weights as float32
    return out


@settings(max_examples=300, deadline=None)
@given(trees=source_trees(), budget=st.integers(0, 30), decay=st.floats(0.3, 1.0), scale=st.floats(0.1, 2.0))
def test_merge_matches_reference(trees, budget, decay, scale):
    M, D = 4, 6
    factors = np.array(
        [
            [[scale * (s + 1) * decay**d * (0.9 ** (M - m)) for d in range(D + 1)] for m in range(M + 1)]
            for s in range(3)
        ]
    )
    table = _core.ScoreTable(M, D, factors.ravel())
    got = _core.merge_trees(trees, table, budget)
    ref_trees = [{**t, "paths": _paths(t)} for t in trees]
    want = merge(ref_trees, lambda s, m, d: factors[s, min(m, M), min(d, D)], budget)
    assert got["tokens"].tolist() == [w[0] for w in want]
    assert got["parents"].tolist() == [w[1] for w in want]
    assert got["depths"].tolist() == [w[2] for w in want]
    assert got["sources"].tolist() == [w[4] for w in want]
    np.testing.assert_allclose(got["scores"], [w[3] for w in want], rtol=1e-6)
    assert len(got["tokens"]) <= budget


@settings(max_examples=200, deadline=None)
@given(trees=source_trees(), budget=st.integers(1, 30))
def test_single_source_gives_the_top_budget_nodes(trees, budget):
    """With one tree and probabilities falling with depth, the draft is exactly
    the `budget` highest-priority nodes (up to ties)."""
    t = trees[0]
    # make weights non-increasing along paths, as counts are
    w = t["weights"].copy()
    for i, p in enumerate(t["parents"]):
        if p >= 0:
            w[i] = min(w[i], w[p])
    t = {**t, "weights": w, "source": 0, "max_depth": 100}
    table = _core.ScoreTable(0, 1, np.ones(3 * 1 * 2))
    got = _core.merge_trees([t], table, budget)
    prio = sorted((float(np.float32(x)) / t["total"] for x in w), reverse=True)
    k = len(got["scores"])
    assert k == min(budget, len(w))
    np.testing.assert_allclose(sorted(got["scores"], reverse=True), prio[:k], rtol=1e-6)


def test_identical_candidates_merge_without_spending_budget():
    a = {
        "tokens": np.array([1, 2], dtype=np.uint32),
        "parents": np.array([-1, 0], dtype=np.int32),
        "weights": np.array([4.0, 4.0]),
        "total": 4.0,
        "source": 0,
        "match_len": 1,
        "max_depth": 4,
    }
    b = {**a, "tokens": np.array([1, 3], dtype=np.uint32), "source": 1}
    table = _core.ScoreTable(1, 4, np.ones(3 * 2 * 5))
    got = _core.merge_trees([a, b], table, 3)
    # token 1 from both sources is one node; both children hang below it
    assert got["tokens"].tolist() == [1, 2, 3]
    assert got["parents"].tolist() == [-1, 0, 0]
    assert got["sources"].tolist() == [0, 0, 1]


def test_budget_zero_and_bad_tree():
    table = _core.ScoreTable(1, 1, np.ones(3 * 2 * 2))
    t = {
        "tokens": np.array([1], dtype=np.uint32),
        "parents": np.array([-1], dtype=np.int32),
        "weights": np.array([1.0]),
        "total": 1.0,
        "source": 0,
        "match_len": 1,
        "max_depth": 2,
    }
    assert len(_core.merge_trees([t], table, 0)["tokens"]) == 0
    with pytest.raises(ValueError, match="earlier node"):
        _core.merge_trees([{**t, "parents": np.array([0], dtype=np.int32)}], table, 4)
    with pytest.raises(ValueError, match="source"):
        _core.merge_trees([{**t, "source": 16}], table, 4)


def test_score_table_validation():
    with pytest.raises(ValueError, match="factors"):
        _core.ScoreTable(2, 2, np.ones(5))
    with pytest.raises(ValueError, match="finite"):
        _core.ScoreTable(0, 1, np.array([1, -1.0, 1, 1, 1, 1]))


def test_discount_params_table_shape():
    t = sssd.DiscountParams().score_table(4, 8)
    assert t.max_match == 4 and t.max_depth == 8
    # the input source is discounted below the datastore at the same match
    assert t(sssd.SOURCE_INPUT, 4, 1) < t(sssd.SOURCE_DATASTORE, 4, 1)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 12), max_size=4, unique=True),
    st.lists(st.integers(2, 40), max_size=4, unique=True),
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5), st.integers(0, 5)), max_size=30),
    st.integers(1, 4),
)
def test_curve_index_equals_a_cell_by_cell_lookup(match_edges, depth_edges, cells, sources):
    """Each (source, match length, depth) cell gets the curve of its bins (the last listed for a
    bin twice), as a lookup cell by cell with the bins found by a linear scan does."""
    cal = sssd.config.Calibration(
        (0, *sorted(match_edges)), (1, *sorted(depth_edges)), tuple((s, m, d, (0.0,), (0.5,)) for s, m, d in cells)
    )

    def bin_of(edges, value):
        i = 0
        while i + 1 < len(edges) and edges[i + 1] <= value:
            i += 1
        return i

    index = {(s, m, d): i for i, (s, m, d, _, _) in enumerate(cal.curves)}
    max_match, max_depth = 14, 45
    got = cal.curve_index(sources, max_match, max_depth)
    assert got.shape == (sources, max_match + 1, max_depth + 1) and (got[:, :, 0] == -1).all()
    for s in range(sources):
        for m in range(max_match + 1):
            for d in range(1, max_depth + 1):
                want = index.get((s, bin_of(cal.match_bins, m), bin_of(cal.depth_bins, d)), -1) if s < 3 else -1
                assert got[s, m, d] == want, (s, m, d)


def test_score_table_sizes_do_not_overflow():
    # max_match + 1 used to be computed in int: for INT_MAX it overflowed
    # (undefined behaviour) and the expected size came out as garbage.
    cells = 3 * 2**31 * 2
    with pytest.raises(ValueError, match=f"score table has 6 factors, expected {cells}$"):
        _core.ScoreTable(2**31 - 1, 1, np.ones(6))
    with pytest.raises(ValueError, match=f"expected {3 * 2 * 2**31}$"):
        _core.ScoreTable(1, 2**31 - 1, np.ones(6))


def test_trees_given_as_lists_are_kept_alive():
    # A list converts to a temporary array; the core used to keep a span into
    # it after the temporary was freed (a use-after-free under ASan). Sizes
    # above 1 KiB: numpy keeps smaller freed buffers in a cache, hiding it.
    n = 300
    table = _core.ScoreTable(1, 2, np.ones(3 * 2 * 3))
    arrays = {
        "tokens": np.arange(n, dtype=np.uint32),
        "parents": np.full(n, -1, dtype=np.int32),
        "weights": np.arange(1.0, n + 1),
        "total": float(n * (n + 1) // 2),
        "source": 0,
        "match_len": 1,
        "max_depth": 2,
    }
    lists = {**arrays, "weights": arrays["weights"].tolist()}
    want = _core.merge_trees([arrays], table, 64)
    got = _core.merge_trees([lists], table, 64)
    assert len(want["tokens"]) == 64 and want["tokens"][0] == n - 1
    for key in ("tokens", "parents", "scores"):
        np.testing.assert_array_equal(got[key], want[key])
    knots = np.linspace(0.0, 1.0, n)
    curves = _core.ScoreTable(
        1, 2, np.ones(3 * 2 * 3), np.zeros(18, np.int32), [(knots.tolist(), (knots / 2).tolist())]
    )
    assert curves.priority(0, 1, 1, 1.0) == 0.5 and curves.priority(0, 1, 1, 0.5) == 0.25


def test_several_external_sources_each_with_its_discount_tag_and_q():
    """Two caller sources propose under one root: each keeps its source tag, its discount ranks
    it, and a node's real draft probability q travels apart from its ranking weight."""
    weak, strong = sssd.SourceDiscount(scale=0.1), sssd.SourceDiscount(scale=1.0)
    drafter = sssd.Drafter(None, sssd.DrafterConfig(use_input=False), external_sources=(weak, strong))
    drafter.open(1, [5, 6, 7])
    ext = {
        "offsets": np.array([0, 4]),
        "tokens": np.array([10, 11, 20, 21]),
        "parents": np.array([-1, 0, -1, 2]),
        "weights": np.array([0.9, 0.9, 0.5, 0.5], np.float32),
        "q": np.array([0.9, 0.9, np.nan, np.nan], np.float32),
        "sources": np.array([2, 2, 3, 3], np.uint8),
    }
    tree = drafter.draft([1], [4], external=ext)[0]
    assert tree.tokens.tolist() == [20, 21, 10, 11]  # 0.5 x 1.0 and 0.25 x 1.0 beat 0.9 x 0.1
    assert tree.sources.tolist() == [3, 3, 2, 2]
    assert np.isnan(tree.draft_probs[:2]).all() and tree.draft_probs[2:].tolist() == pytest.approx([0.9, 0.9])
    assert drafter.draft([1], [1], external=ext)[0].tokens.tolist() == [20]
    # a node under another source's node, an unknown tag, a weight above 1: refused
    for key, bad in (
        ("parents", np.array([-1, 0, 1, 2])),
        ("sources", np.array([2, 2, 16, 16], np.uint8)),
        ("weights", np.array([1.5, 0.9, 0.5, 0.5], np.float32)),
    ):
        with pytest.raises(ValueError):
            drafter.draft([1], [4], external={**ext, key: bad})
