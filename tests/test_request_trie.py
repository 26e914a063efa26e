"""The per-request input trie against brute-force n-gram counts."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import tree_to_paths, trie_continuations

from sssd import _core


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 6), min_size=1, max_size=120), depth=st.integers(2, 9))
def test_continuations_match_brute_force(tokens, depth):
    trie = _core.RequestTrie(depth)
    trie.extend(np.array(tokens, dtype=np.uint32))
    assert trie.check_integrity() == ""
    for length in range(1, depth):
        got = trie.continuations(length)
        want, total = trie_continuations(tokens, length, depth)
        assert tree_to_paths(got) == want, length
        if want:
            assert got["total"] == total


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=80), cuts=st.lists(st.integers(0, 80), max_size=6))
def test_incremental_equals_rebuilt(tokens, cuts):
    """Appending in any chunks gives the same trie as inserting everything at once."""
    whole = _core.RequestTrie(6)
    whole.extend(np.array(tokens, dtype=np.uint32))
    inc = _core.RequestTrie(6)
    bounds = sorted({0, len(tokens), *[c for c in cuts if c <= len(tokens)]})
    for a, b in zip(bounds, bounds[1:]):
        inc.extend(np.array(tokens[a:b], dtype=np.uint32))
    assert inc.num_nodes == whole.num_nodes and inc.size == whole.size
    for length in range(1, 6):
        assert tree_to_paths(inc.continuations(length)) == tree_to_paths(whole.continuations(length))


def test_memory_is_bounded_by_depth_and_cap():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, 5_000).astype(np.uint32)  # nearly all n-grams distinct
    trie = _core.RequestTrie(8)
    trie.extend(tokens)
    assert trie.num_nodes <= 8 * len(tokens) + 1
    assert trie.memory_bytes() <= 100 * trie.num_nodes + 4 * len(tokens) + 1024
    capped = _core.RequestTrie(8, 1000)
    capped.extend(tokens)
    assert capped.num_nodes == 1000 and capped.check_integrity() == ""


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=12), min_size=1, max_size=6),
    order=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    noise=st.lists(st.integers(0, 30), max_size=20),
)
def test_long_repeats_at_depth_20_match_brute_force(blocks, order, noise):
    """Text made of repeated blocks (long verbatim repeats, chains of only children) at the
    default depth: the child index holds only branching nodes' children, and lookups past it
    (a node's single child checked in place, a second child moving both into the index) agree
    with brute force."""
    tokens = [t for i in order for t in blocks[i % len(blocks)]] + noise
    trie = _core.RequestTrie(20)
    for t in tokens:  # token by token: every append goes through the lookup
        trie.extend(np.array([t], dtype=np.uint32))
    assert trie.check_integrity() == ""
    for length in range(1, 20):
        got = trie.continuations(length)
        want, total = trie_continuations(tokens, length, 20)
        assert tree_to_paths(got) == want, length
        if want:
            assert got["total"] == total


def test_child_index_holds_only_branching_nodes():
    """Text whose n-grams never repeat is chains under the root: the index holds the root's
    children only, so the trie costs little more than its 16-byte nodes."""
    tokens = np.arange(1, 20_001, dtype=np.uint32)
    trie = _core.RequestTrie(20)
    trie.extend(tokens)
    assert trie.check_integrity() == ""
    assert trie.num_nodes == 1 + sum(min(20, len(tokens) - i) for i in range(len(tokens)))
    # nodes (16 B) + the root's 20,000 children at <= 64 B each + the text and the tail
    assert trie.memory_bytes() <= 16 * trie.num_nodes * 1.5 + 64 * len(tokens) + 8 * len(tokens)


def test_repeated_phrase_predicts_its_continuation():
    trie = _core.RequestTrie(6)
    trie.extend(np.array([5, 6, 7, 8, 1, 5, 6, 7, 8, 2, 5, 6], dtype=np.uint32))
    d = trie.continuations(2)  # "5 6" seen twice before, always followed by "7 8"
    paths = tree_to_paths(d)
    assert d["total"] == 2 and paths[(7,)] == 2 and paths[(7, 8)] == 2


def test_separator_id_is_rejected():
    trie = _core.RequestTrie(4)
    with pytest.raises(ValueError, match="separator"):
        trie.extend(np.array([1, 2**32 - 1], dtype=np.uint32))


def test_bad_depth():
    with pytest.raises(ValueError, match="depth"):
        _core.RequestTrie(1)
