"""The copy source (issue 28): the request's longest repeat of any length, found by its suffix
automaton, followed deep, ranked by the request's own evidence. Checked against brute force."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sssd
from sssd import _core


def brute_repeat(t: list[int]) -> tuple[int, list[int]]:
    """The longest suffix of t that also ends earlier, and every earlier end (most recent first)."""
    n = len(t)
    for L in range(n - 1, 0, -1):
        suf = t[n - L :]
        ends = [e for e in range(L - 1, n - 1) if t[e - L + 1 : e + 1] == suf]
        if ends:
            return L, ends[::-1]
    return 0, []


#: SuffixAutomaton::kTrack: the states on a new position's suffix-link path that record it.
TRACK = 8


def path_index(t: list[int], e: int, L: int) -> int:
    """Where the length-L suffix of t[: e + 1] sat on the suffix-link path when position e was
    appended: the number of distinct end-position sets among its longer suffixes (0: the whole
    prefix's state). The automaton records e in the first TRACK states of that path only."""
    P = t[: e + 1]
    n = len(P)
    k, prev = -1, None
    for length in range(n, L - 1, -1):
        ends = frozenset(j for j in range(length - 1, n) if P[j - length + 1 : j + 1] == P[n - length :])
        if ends != prev:
            k, prev = k + 1, ends
    return k


def automaton(tokens, **kw):
    a = _core.SuffixAutomaton(**kw)
    a.extend(np.asarray(tokens, dtype=np.uint32))
    return a


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=80))
def test_longest_repeat_equals_brute_force_after_every_token(tokens):
    a = _core.SuffixAutomaton()
    for i, t in enumerate(tokens):
        a.extend(np.array([t], dtype=np.uint32))
        length, ends = a.longest_repeat()
        want, all_ends = brute_repeat(tokens[: i + 1])
        assert length == want
        assert (length == 0) == (not ends)
        assert set(ends) <= set(all_ends) and ends == sorted(ends, reverse=True)  # real occurrences, newest first
        if ends and path_index(tokens, all_ends[0], want) < TRACK:
            assert ends[0] == all_ends[0]  # the newest, wherever that occurrence recorded it
    assert a.check_integrity() == ""
    assert a.num_states <= max(1, 2 * len(tokens))


def test_a_long_verbatim_repeat_is_found_whatever_its_length():
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 50_000, 3000).tolist()
    a = automaton(doc + rng.integers(0, 50_000, 50).tolist() + doc[:2500])
    length, ends = a.longest_repeat()
    assert length == 2500 and ends == [2499]


def test_one_token_repeated_100k_times_costs_linear_time_and_bounded_memory():
    t0 = time.perf_counter()
    a = automaton(np.full(100_000, 7))
    elapsed = time.perf_counter() - t0
    length, ends = a.longest_repeat()
    assert length == 99_999 and ends[0] == 99_998
    assert a.num_states == 100_001  # one state per token: no clones for a single repeated token
    assert a.memory_bytes() <= 180 * 100_000 + 4096
    assert elapsed < 5  # linear (a quadratic walk would take minutes); generous for slow machines


def test_the_cap_stops_growth_and_says_so():
    a = automaton(np.arange(100) % 7, max_tokens=50)
    assert a.capped and a.size == 50 and a.longest_repeat() == (0, [])
    mem = a.memory_bytes()
    a.extend(np.arange(1000, dtype=np.uint32))
    assert a.memory_bytes() == mem


def brute_evidence(tokens, min_match, half_life, ends_of):
    """Hits and trials of the copy evidence: before each token, the newest earlier occurrence
    (ends_of: the automaton's) of a repeat >= min_match predicts the token after it."""
    decay = 2.0 ** (-1.0 / half_life)
    hits = trials = 0.0
    for i in range(1, len(tokens)):
        length, ends = ends_of(i)
        if length >= min_match:
            hits = decay * hits + (tokens[ends[0] + 1] == tokens[i])
            trials = decay * trials + 1
    return hits, trials


@pytest.mark.parametrize("seed", range(4))
def test_the_requests_evidence_equals_a_recount(seed):
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 40, int(rng.integers(5, 20))).tolist() for _ in range(4)]
    tokens = []
    while len(tokens) < 400:
        p = list(phrases[int(rng.integers(4))])
        if rng.random() < 0.3:
            p[int(rng.integers(len(p)))] = int(rng.integers(0, 40))  # an edit
        tokens += p
    trie = _core.RequestTrie(8, 1 << 20, 1 << 20, 6, 16.0)
    prefixes = []
    for t in tokens:
        prefixes.append(trie.repeat())
        trie.extend(np.array([t], dtype=np.uint32))
    hits, trials = brute_evidence(tokens, 6, 16.0, lambda i: prefixes[i])
    assert trials > 10
    assert trie.copy_hits == pytest.approx(hits) and trie.copy_trials == pytest.approx(trials)
    assert trie.copy_rate(0.5, 4.0) == pytest.approx((hits + 0.5 * 4) / (trials + 4))
    assert trie.check_integrity() == ""


def test_a_copy_is_followed_as_far_as_the_budget():
    rng = np.random.default_rng(1)
    doc = rng.integers(10, 1000, 300).tolist()
    d = sssd.Drafter(None, sssd.DrafterConfig(budget=64))
    tree = d.draft_prefix(doc + [5, 6] + doc[:20], 64)
    assert tree.chain_tokens().tolist()[:64] == doc[20:84]
    assert tree.depths.max() == 64


def test_after_an_edit_the_copy_rejoins_its_source():
    """A token replaced in the copy: the source right after the edit is drafted again."""
    rng = np.random.default_rng(2)
    doc = rng.integers(10, 1000, 200).tolist()
    copied = doc[:60] + [7]  # doc[60] replaced by 7 ...
    d = sssd.Drafter(None, sssd.DrafterConfig(budget=32))
    tree = d.draft_prefix(doc + [3] + copied + [doc[61]], 32)  # ... and the copy went on with doc[61]
    assert tree.chain_tokens().tolist()[:20] == doc[62:82]


def test_a_request_that_keeps_copying_ranks_its_copy_higher_than_one_that_does_not():
    rng = np.random.default_rng(3)
    doc = rng.integers(10, 1000, 400).tolist()
    noise = rng.integers(10, 1000, 400).tolist()
    cfg = sssd.DrafterConfig(budget=32, use_datastore=False, copy_rate=0.6, copy_evidence=2.0)
    d = sssd.Drafter(None, cfg)
    # both end in the same 20-token repeat of doc; one got there copying, the other editing every third token
    copier = doc + [1] + doc[:200]
    editor = doc + [1] + [x if i % 3 else 5 for i, x in enumerate(doc[:180])] + doc[180:200]
    stranger = doc + [1] + noise[:180] + doc[180:200]
    trees = [d.draft_prefix(c, 32) for c in (copier, editor, stranger)]
    for t in trees:
        assert t.chain_tokens().tolist()[:12] == doc[200:212]
    # the copy node at depth 12: rate^12, the rate measured on each request's own text
    deep = [float(t.scores[t.depths == 12].max()) for t in trees]
    assert deep[0] > 1.5 * max(deep[1], deep[2])


def assert_stateful_equals_stateless(d, text, start: int, budget: int, step) -> None:
    """Opens request 0 on text[:start], extends it by step(pos) tokens at a time, and checks after
    every extension that its draft equals the draft of its text from scratch."""
    d.open(0, text[:start])
    pos = start
    while pos < len(text):
        k = step(pos)
        d.extend(0, text[pos : pos + k])
        pos += k
        a, b = d.draft([0], budget)[0], d.draft_prefix(text[:pos], budget)
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        np.testing.assert_array_equal(a.scores, b.scores)


def test_stateful_equals_stateless_with_the_copy_source():
    rng = np.random.default_rng(4)
    phrases = [rng.integers(0, 60, 30).tolist() for _ in range(3)]
    text = sum((phrases[int(rng.integers(3))] for _ in range(12)), [])
    d = sssd.Drafter(None, sssd.DrafterConfig(budget=48))
    assert_stateful_equals_stateless(d, text, 40, 48, lambda pos: int(rng.integers(1, 9)))


@pytest.mark.parametrize("budget", [0, 1, int(_core.MAX_BUDGET)])
def test_budgets_zero_one_and_max_on_a_repeated_token(budget):
    d = sssd.Drafter(None, sssd.DrafterConfig(budget=8))
    d.open(0, np.full(100_000, 9))
    tree = d.draft([0], budget)[0]
    assert len(tree) == min(budget, 64)  # one chain of 9s, as deep as the copy source goes (overlapping)
    assert set(tree.tokens.tolist()) <= {9}
    assert d.request_memory(0) < 100_000 * 400  # trie + automaton, bounded per token


@pytest.mark.parametrize(
    "field,value",
    [
        ("copy_min_match", 0),
        ("copy_max_branch_len", -1),
        ("copy_rate", 0.0),
        ("copy_rate", 1.5),
        ("copy_occurrences", 4),
        ("copy_evidence", 0.0),
        ("copy_half_life", -1.0),
    ],
)
def test_bad_copy_settings_are_refused_by_name(field, value):
    with pytest.raises((ValueError, TypeError), match=field):
        sssd.DrafterConfig(**{field: value})


def test_a_periodic_text_goes_on_with_its_period():
    text = [4, 5, 6] * 10
    tree = sssd.Drafter(None, sssd.DrafterConfig(budget=40)).draft_prefix(text, 40)
    assert tree.chain_tokens().tolist()[:40] == ([4, 5, 6] * 14)[:40]


def test_the_copy_source_can_be_switched_off():
    rng = np.random.default_rng(5)
    doc = rng.integers(10, 1000, 300).tolist()
    d = sssd.Drafter(None, sssd.DrafterConfig(budget=64, copy_max_branch_len=0))
    tree = d.draft_prefix(doc + [5] + doc[:20], 64)
    assert tree.depths.max() <= 16  # the n-gram trie's continuations only


def test_an_edit_made_once_is_proposed_again_where_the_source_has_it_again():
    """A rename: the copy remembers what it wrote instead of the source, and drafts it again."""
    rng = np.random.default_rng(6)
    body = [int(x) for x in rng.integers(100, 1000, 120)]
    old, new = 42, 43
    for i in (10, 40, 70, 100):
        body[i] = old
    edited = [new if t == old else t for t in body]
    d = sssd.Drafter(None, sssd.DrafterConfig(budget=64))
    # the copy has written the first renamed site and gone on past it
    prefix = body + [7, 8] + edited[:30]
    trie = _core.RequestTrie(20, 1 << 22, 1 << 20, 8, 32.0)
    trie.extend(np.asarray(prefix, dtype=np.uint32))
    assert (old, [], [new]) in [(a, r, i) for a, r, i in trie.copy_edits] or any(
        r == [old] and i == [new] for _, r, i in trie.copy_edits
    )
    tree = d.draft_prefix(prefix, 64)
    paths = {tuple(p) for p in tree_paths(tree)}
    assert any(p[:20] == tuple(edited[30:50]) for p in paths)  # the next site (40) edited as before


def numbered_listing(rng, lines: int, first: int = 40):
    """A file read with numbered lines (tool output: "\\n", spaces, the line's digits, " |", the
    line) and the same lines written back without their numbers, as token ids: 1 newline, 2 spaces,
    3 " |", 10-19 digits, line contents from 100 up."""
    body = [rng.integers(100, 1000, int(rng.integers(4, 9))).tolist() for _ in range(lines)]
    listing, written = [], []
    for k, line in enumerate(body):
        listing += [1, 2] + [10 + int(c) for c in str(first + k)] + [3] + line
        written += [1] + line
    return listing, written


def test_lines_read_with_numbers_are_written_back_without_them_across_line_breaks():
    """Once the output has dropped two lines' numbers, its copy reads on across the next line breaks:
    the edit (remove newline, spaces, digits, " |"; write a newline) applies at sites whose digits differ."""
    rng = np.random.default_rng(11)
    listing, written = numbered_listing(rng, 12)
    cut = written.index(1, written.index(1, 1) + 1) + 3  # two lines written, then 2 tokens of the third
    prefix = listing + [7, 8] + written[:cut]
    tree = sssd.Drafter(None, sssd.DrafterConfig(budget=64, use_datastore=False)).draft_prefix(prefix, 64)
    best = max(tree_paths(tree), key=lambda p: _common(p, written[cut:]))
    assert _common(best, written[cut:]) >= 30  # three more line breaks at least
    assert sum(1 for t in written[cut : cut + _common(best, written[cut:])] if t == 1) >= 3


def test_a_numbered_listing_drafts_the_same_stateful_and_stateless():
    rng = np.random.default_rng(12)
    listing, written = numbered_listing(rng, 30, first=95)  # two and three digits
    written = written[:60] + [5, 5] + written[60:]  # and an edit of its own
    text = listing + [7] + written
    d = sssd.Drafter(None, sssd.DrafterConfig(budget=48, use_datastore=False))
    assert_stateful_equals_stateless(d, text, len(listing) + 1, 48, lambda pos: int(rng.integers(1, 6)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=8, max_size=40), st.lists(st.integers(0, 5), min_size=20, max_size=200))
def test_stateful_equals_stateless_on_small_alphabets_where_edits_match_fuzzily(lines, edits):
    """A listing of lines with two-token numbers from a six-token alphabet, copied back without the
    numbers and with a token replaced here and there, then random: repeats, edits and fuzzy sites
    everywhere. Every draft of the open request equals the draft of its text from scratch (and
    nothing crashes mid-insertion)."""
    listing, written = [], []
    for k in range(0, len(lines) - 3, 4):
        listing += [6, 7, 8 + k % 3, 8 + (k // 3) % 3, 9] + lines[k : k + 4]
        noise = edits[k % len(edits)]
        written += [6] + [t if noise != j else 11 for j, t in enumerate(lines[k : k + 4])]
    text = listing + [10] + written + edits
    d = sssd.Drafter(None, sssd.DrafterConfig(budget=24, use_datastore=False, copy_min_match=4))
    assert_stateful_equals_stateless(d, text, len(listing) + 1, 24, lambda pos: 1 + pos % 3)


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def tree_paths(tree):
    kids: dict[int, list[int]] = {}
    for k, p in enumerate(tree.parents.tolist()):
        kids.setdefault(p, []).append(k)
    out, stack = [], [(-1, [])]
    while stack:
        node, path = stack.pop()
        if node not in kids:
            out.append(path)
        for c in kids.get(node, []):
            stack.append((c, path + [int(tree.tokens[c])]))
    return out


def test_a_pipeline_names_the_copy_sources_nodes_from_the_start():
    """The engine names accepted tokens by the pipeline's source_names: a fresh pipeline (no source
    added or removed since) must know the copy source's tag, or its tokens are counted as "external"."""
    from sssd.sources import DraftPipeline, DraftRequest, RetrievalSource

    pipe = DraftPipeline([RetrievalSource(None)], sssd.DrafterConfig(use_datastore=False))
    text = np.arange(100, 140).tolist() * 2 + list(range(100, 110))  # a 40-token passage, copied again
    pipe.open(0, np.asarray(text))
    batch = pipe.draft([DraftRequest(0, np.asarray(text), 16)])
    tags = set(batch.sources.tolist())
    assert 15 in tags and pipe.source_names[15] == "copy"
    assert all(t in pipe.source_names for t in tags)
    pipe.close(0)


@pytest.mark.parametrize("budget", [4, 16, 48])
def test_a_confident_copy_skips_the_datastore_query_and_drafts_the_same(small_datastore_dir, words, budget):
    """Drafter.draft asks the datastore only when the other sources' candidates do not fill the
    budget above anything it could offer; draft_prefix asks it always. Their drafts must be equal
    step by step over an answer that copies its prompt (queries skipped) and one that does not."""
    tokens, _ = words
    docs = np.split(tokens, np.flatnonzero(tokens == sssd.SEPARATOR) + 1)
    passage = np.concatenate([d[:-1] for d in docs[8:10]]).tolist()  # corpus text: the datastore matches it too
    other = np.concatenate([d[:-1] for d in docs[5:7]]).tolist()
    rng = np.random.default_rng(5)
    edited = [x if rng.random() > 0.03 else int(tokens[int(rng.integers(len(tokens)))]) for x in passage]
    ds = sssd.Datastore.open(small_datastore_dir)
    d = sssd.Drafter(ds, sssd.DrafterConfig(budget=budget))
    for text in (passage + other[:40] + edited, passage + other):
        assert_stateful_equals_stateless(d, text, len(passage) + 40, budget, lambda pos: int(rng.integers(1, 6)))
        d.close(0)
    drafted, skipped = d.datastore_queries
    assert drafted > 100 and 0 < skipped < drafted, (drafted, skipped)
