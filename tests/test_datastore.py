"""Datastore queries against brute force; the on-disk format and its failure modes."""

import json
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import random_corpus
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import SEP, datastore_query, occurrences, suffix_array, tree_to_paths

import sssd
from sssd import _core


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), plen=st.integers(1, 4))
def test_find_counts_match_naive_scan(seed, plen):
    rng = np.random.default_rng(seed)
    tokens = random_corpus(rng, 20, vocab=12)
    ds = sssd.Datastore.from_tokens(tokens)
    t = tokens.tolist()
    start = int(rng.integers(0, len(t) - plen + 1))
    pattern = t[start : start + plen]
    if SEP in pattern:
        pattern = [x for x in pattern if x != SEP] or [0]
    lo, hi = ds.find(pattern)
    occ = occurrences(t, pattern)
    assert hi - lo == len(occ)
    assert sorted(ds.positions(pattern).tolist()) == occ


query_params = st.fixed_dictionaries(
    {
        "max_match": st.integers(1, 6),
        "max_samples": st.integers(1, 12),
        "min_occurrences": st.integers(0, 30),
        "branch_len": st.integers(1, 6),
        "end_token": st.sampled_from([-1, 999]),
    }
)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), params=query_params, ctx_len=st.integers(1, 8))
def test_query_matches_reference(seed, params, ctx_len):
    rng = np.random.default_rng(seed)
    tokens = random_corpus(rng, 25, vocab=10)
    t = tokens.tolist()
    ds = sssd.Datastore.from_tokens(tokens)
    context = [int(x) for x in rng.integers(0, 10, ctx_len)]
    got = ds.query(context, min_match=1, **params)
    want, match_len, total = datastore_query(t, suffix_array(t), context, min_match=1, **params)
    assert got["match_len"] == match_len
    assert got["total"] == total
    assert tree_to_paths(got) == want


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    min_occ=st.integers(0, 40),
    max_match=st.integers(1, 10),
    ctx_len=st.integers(1, 12),
    repeat=st.sampled_from([0.3, 0.9]),
)
def test_backoff_by_weighted_occurrences_equals_level_by_level(seed, min_occ, max_match, ctx_len, repeat):
    """With min_occurrences <= max_samples the core weights the occurrences of
    the suffix one longer than the base level instead of sampling each level;
    the tree must be the level-by-level one. Contexts copied from the corpus
    make long matches (many levels) common."""
    rng = np.random.default_rng(seed)
    tokens = random_corpus(rng, 40, vocab=6, repeat=repeat)
    t = tokens.tolist()
    ds = sssd.Datastore.from_tokens(tokens)
    start = int(rng.integers(0, len(t)))
    context = [x for x in t[start : start + ctx_len] if x != SEP] or [1]
    params = dict(max_match=max_match, max_samples=64, min_occurrences=min_occ, branch_len=4, end_token=999)
    got = ds.query(context, min_match=1, **params)
    want, match_len, total = datastore_query(t, suffix_array(t), context, min_match=1, **params)
    assert got["match_len"] == match_len
    assert tree_to_paths(got) == want
    assert got["total"] == total


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    min_occ=st.integers(0, 40),
    max_match=st.integers(1, 10),
    ctx_len=st.integers(1, 12),
    repeat=st.sampled_from([0.3, 0.9]),
    per_match=st.sampled_from([0.0, 0.5, 1.0, 2.5]),
    max_branch=st.integers(1, 12),
    boost=st.sampled_from([1.0, 1.5, 2.0]),
    samples=st.sampled_from([3, 64]),
)
def test_adaptive_depth_and_match_boost_equal_the_level_by_level_reference(
    seed, min_occ, max_match, ctx_len, repeat, per_match, max_branch, boost, samples
):
    """Adaptive depth (an occurrence matching m context tokens continues for
    clamp(per_match * m, branch_len, max_branch_len)) and the match boost (level L weighs
    boost^(L - lowest level)) give the brute-force level-by-level tree, on both
    backoff paths (weighted occurrences when min_occurrences <= max_samples, else
    level by level)."""
    rng = np.random.default_rng(seed)
    tokens = random_corpus(rng, 40, vocab=6, repeat=repeat)
    t = tokens.tolist()
    ds = sssd.Datastore.from_tokens(tokens)
    start = int(rng.integers(0, len(t)))
    context = [x for x in t[start : start + ctx_len] if x != SEP] or [1]
    params = dict(
        max_match=max_match,
        max_samples=samples,
        min_occurrences=min_occ,
        branch_len=2,
        end_token=999,
        branch_per_match=per_match,
        max_branch_len=max_branch,
        match_boost=boost,
    )
    got = ds.query(context, min_match=1, **params)
    want, match_len, total = datastore_query(t, suffix_array(t), context, min_match=1, **params)
    assert got["match_len"] == match_len
    paths = tree_to_paths(got)
    assert paths.keys() == want.keys()
    for path, w in want.items():
        assert paths[path] == pytest.approx(w, rel=1e-5), path
    assert got["total"] == pytest.approx(total, rel=1e-5)


def test_a_long_verbatim_match_is_followed_to_budget_depth():
    """A 32-token context that occurs once in a corpus of noisy near-copies: a budget-64
    draft with the default config follows the document's continuation for >= 48 tokens
    (fixed-depth datastore branches stopped at 16)."""
    rng = np.random.default_rng(4)
    doc = rng.integers(0, 500, 200)
    docs = [doc]
    for _ in range(300):  # other documents share short pieces of it, never 32 tokens in a row
        d = doc.copy()
        d[rng.integers(0, 200, 90)] = rng.integers(0, 500, 90)
        docs.append(d)
    docs += [rng.integers(0, 500, 200) for _ in range(300)]
    corpus = np.concatenate([np.append(d, SEP) for d in docs]).astype(np.uint32)
    ds = sssd.Datastore.from_tokens(corpus)
    context, continuation = doc[60:92], doc[92:156]
    assert ds.count(context) == 1
    followed = {}
    for name, cfg in (("fixed", sssd.DrafterConfig(datastore_branch_per_match=0)), ("default", sssd.DrafterConfig())):
        tree = sssd.Drafter(ds, cfg, use_input=False).draft_prefix(context, 64)
        node, n = -1, 0
        while n < len(continuation):
            kids = np.flatnonzero((tree.parents == node) & (tree.tokens == continuation[n]))
            if not kids.size:
                break
            node, n = int(kids[0]), n + 1
        followed[name] = n
    assert followed["fixed"] <= 16
    assert followed["default"] >= 48, followed


def test_continuations_never_cross_separators(rng):
    tokens = random_corpus(rng, 200, vocab=8)
    t = tokens.tolist()
    ds = sssd.Datastore.from_tokens(tokens)
    docs = " ".join(map(str, t)).split(str(SEP))
    for _ in range(50):
        ctx = [int(x) for x in rng.integers(0, 8, 3)]
        d = ds.query(ctx, max_match=3, branch_len=8, min_occurrences=1000)
        for path in tree_to_paths(d):
            # some matched suffix (backoff merges several) + path lies inside one document
            seqs = [" ".join(map(str, ctx[3 - L :] + list(path))) for L in range(1, d["match_len"] + 1)]
            assert any(f" {q} " in f" {doc.strip()} " for doc in docs for q in seqs), (ctx, path)


def test_regular_interval_sampling_tracks_the_distribution():
    # "A B" is followed by C 70% of the time, D 20%, E 10%, in 10,000 documents.
    rng = np.random.default_rng(7)
    nexts = rng.choice([3, 4, 5], size=10_000, p=[0.7, 0.2, 0.1])
    tokens = np.array([x for n in nexts for x in (1, 2, int(n), SEP)], dtype=np.uint32)
    ds = sssd.Datastore.from_tokens(tokens)
    d = ds.query([1, 2], max_match=2, max_samples=100, branch_len=1)
    w = dict(zip(d["tokens"].tolist(), d["weights"].tolist()))
    counts = np.bincount(nexts, minlength=6)
    # Stratified over the sorted range: each share is exact to within one sample.
    for tok in (3, 4, 5):
        assert abs(w[tok] - 100 * counts[tok] / 10_000) <= 1
    # Taking the first M instead would have seen only C.
    assert d["total"] == 100


def test_backoff_sums_levels_until_threshold():
    tokens = np.array([7, 1, 2, 3, SEP, 1, 2, 4, SEP, 2, 5, SEP, 2, 6, SEP], dtype=np.uint32)
    ds = sssd.Datastore.from_tokens(tokens)
    # "7 1 2" occurs once (< 3) -> also "1 2" (twice, < 3) -> also "2" (4 times: stop).
    d = ds.query([7, 1, 2], max_match=3, min_occurrences=3, branch_len=1)
    assert d["match_len"] == 3
    paths = tree_to_paths(d)
    # level 3: {3}, level 2 ("1 2"): {3, 4}, level 1 ("2"): {3, 4, 5, 6} -> stops at level 1 (4 >= 3)
    assert paths == {(3,): 3.0, (4,): 2.0, (5,): 1.0, (6,): 1.0}
    assert d["levels"] == 3


def test_large_vocabulary_ids(tmp_path):
    big = [70_000, 4_000_000_000, 123_456_789]
    tokens = np.array(big * 5 + [SEP] + big, dtype=np.uint32)
    ds = sssd.Datastore.build(tokens, tmp_path / "ds")
    assert ds.count([70_000, 4_000_000_000]) == 6
    d = ds.query([70_000, 4_000_000_000], max_match=2, branch_len=1, min_occurrences=1)
    assert d["tokens"].tolist() == [123_456_789]


def test_build_open_roundtrip_is_mmapped(tmp_path, words):
    tokens, _ = words
    ds = sssd.Datastore.build(tokens, tmp_path / "ds", metadata={"note": "x"})
    assert ds.native.mapped and ds.size == len(tokens)
    assert ds.manifest["note"] == "x" and ds.manifest["num_tokens"] == len(tokens)
    np.testing.assert_array_equal(ds.tokens, tokens)
    assert not ds.tokens.flags.writeable
    again = sssd.Datastore.open(tmp_path / "ds")
    mem = sssd.Datastore.from_tokens(tokens)
    ctx = tokens[100:104]
    assert tree_to_paths(again.query(ctx)) == tree_to_paths(mem.query(ctx))


def test_build_refuses_to_overwrite_unless_asked(tmp_path):
    sssd.Datastore.build([1, 2, 3], tmp_path / "ds")
    with pytest.raises(FileExistsError):
        sssd.Datastore.build([1, 2], tmp_path / "ds")
    ds = sssd.Datastore.build([4, 5], tmp_path / "ds", overwrite=True)
    assert ds.size == 2
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]  # no temporary leftovers


def test_failed_build_leaves_nothing(tmp_path):
    def boom(done, total):
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        sssd.Datastore.build(np.array([1, 2] * 2000, dtype=np.uint32), tmp_path / "ds", progress=boom)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", [[-1, 2], [2**32], [1.5, 2.0], [[1, 2]]])
def test_build_rejects_bad_tokens(tmp_path, bad):
    with pytest.raises((ValueError, TypeError)):
        sssd.Datastore.build(bad, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


# --- corrupt and incompatible files -------------------------------------


@pytest.fixture
def built(tmp_path):
    sssd.Datastore.build(np.array([1, 2, 3, SEP, 1, 2, 4], dtype=np.uint32), tmp_path / "ds")
    return tmp_path / "ds"


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_missing_datastore_and_files(tmp_path, built):
    with pytest.raises(sssd.DatastoreError, match="not found"):
        sssd.Datastore.open(tmp_path / "nope")
    os.remove(built / "suffix_array.bin")
    with pytest.raises(sssd.DatastoreError, match="cannot open"):
        sssd.Datastore.open(built)


def test_bad_magic(built):
    _patch(built / "tokens.bin", 0, b"NOTSSSD!")
    with pytest.raises(sssd.DatastoreError, match="bad magic"):
        sssd.Datastore.open(built)


def test_newer_format_version(built):
    _patch(built / "suffix_array.bin", 8, struct.pack("<I", 99))
    with pytest.raises(sssd.DatastoreError, match="newer"):
        sssd.Datastore.open(built)
    m = json.loads((built / "manifest.json").read_text())
    m["format_version"] = 99
    (built / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(sssd.DatastoreError, match="newer"):
        sssd.Datastore.open(built)


def test_truncated_file(built):
    data = (built / "tokens.bin").read_bytes()
    (built / "tokens.bin").write_bytes(data[:-3])
    with pytest.raises(sssd.DatastoreError, match="truncated"):
        sssd.Datastore.open(built)
    (built / "tokens.bin").write_bytes(data[:10])
    with pytest.raises(sssd.DatastoreError, match="truncated"):
        sssd.Datastore.open(built)


def test_mismatched_files(tmp_path, built):
    other = sssd.Datastore.build(np.array([9, 8, 7, 6, 5, 4, 3], dtype=np.uint32), tmp_path / "other")
    os.replace(other.path / "suffix_array.bin", built / "suffix_array.bin")
    with pytest.raises(sssd.DatastoreError, match="different token stream"):
        sssd.Datastore.open(built)


def test_out_of_range_suffix_entry_raises_not_crashes(built):
    _patch(built / "suffix_array.bin", 64, struct.pack("<I", 10**6))
    # Headers are fine; the structural validation at open reads the entries.
    with pytest.raises(sssd.SSSDError, match=r"suffix_array\.bin: corrupt: entry 0 = 1000000 is outside"):
        sssd.Datastore.open(built)
    # Unvalidated, the bounds-checked accessors raise when a query reaches it.
    ds = sssd.Datastore(_core.Datastore.open(str(built), validate=False))
    with pytest.raises(sssd.SSSDError, match="corrupt suffix array"):
        for ctx in ([1], [2], [3], [4], [1, 2]):
            ds.query(ctx)


def test_garbage_manifest(built):
    (built / "manifest.json").write_text("{not json")
    with pytest.raises(sssd.DatastoreError, match="unreadable manifest"):
        sssd.Datastore.open(built)


def test_a_corrupt_datastore_is_a_value_error_and_an_sssd_error(built):
    _patch(built / "tokens.bin", 0, b"NOTSSSD!")
    for handler in (ValueError, sssd.SSSDError, sssd.DatastoreError):
        with pytest.raises(handler, match="bad magic"):
            sssd.Datastore.open(built)
    (built / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable manifest"):
        sssd.Datastore.open(built)


def test_open_default_is_the_default_datastore_and_never_builds_it(tmp_path, built, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").mkdir()  # a folder named "default" here is not what "default" means
    monkeypatch.setenv("SSSD_DATASTORE", str(built))
    ds = sssd.Datastore.open("default")
    assert ds.path == built and ds.size == 7
    monkeypatch.setenv("SSSD_DATASTORE", str(tmp_path / "not-built"))
    with pytest.raises(FileNotFoundError) as e:
        sssd.Datastore.open("default")
    message = str(e.value)
    assert "\n" not in message and "the default datastore is not built yet" in message
    assert "`sssd build --default`" in message and str(tmp_path / "not-built") in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["default", "ds"]  # nothing was built


# --- structural validation at open (bodies whose headers are fine) ----------


def _run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    """Runs code in a child interpreter (a crash there fails the test, not the session)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def test_empty_backoff_level_of_a_corrupt_index_raises_or_drafts_never_crashes(built):
    # tokens 1 2 3 SEP 1 2 4: token 1 owns ranks [0, 2), token 2 ranks [2, 4).
    # Entry 2 = 4 gives token 1 ranks [0, 4) and token 2 none: "1 2" is still
    # found, "2" no longer. Backing off level by level (min_occurrences >
    # max_samples) from "1 2" to "2" then sampled an empty range, reading
    # before the start of an empty vector (SIGSEGV).
    _patch(built / "token_index.bin", 64 + 2 * 8, struct.pack("<Q", 4))
    with pytest.raises(ValueError, match=r"token_index\.bin and .*suffix_array\.bin disagree"):
        _core.Datastore.open(str(built))
    with pytest.raises(sssd.SSSDError, match=r"token_index\.bin"):
        sssd.Datastore.open(built)
    code = textwrap.dedent("""
        import sys, sssd
        from sssd import _core
        ds = sssd.Datastore(_core.Datastore.open(sys.argv[1], validate=False))
        for budget in (1, 8, 32):
            tree = sssd.Drafter(ds, max_samples=1, min_occurrences=100, use_input=False).draft_prefix([7, 1, 2], budget)
            assert all(-1 <= p < i for i, p in enumerate(tree.parents.tolist())), tree
            assert all(0 <= t < 5 for t in tree.tokens.tolist()), tree
        print("drafted", len(tree))
    """)
    proc = _run_python(code, str(built))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("drafted")


def _rewrite_fingerprint(d):
    tokens = np.fromfile(d / "tokens.bin", dtype=np.uint32, offset=64)
    fp = struct.pack("<Q", int(_core.stream_stats(tokens)["fingerprint"]))
    for name in ("tokens.bin", "suffix_array.bin", "token_index.bin"):
        _patch(d / name, 40, fp)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        # token id 9 >= vocab_size 5 (the header's), fingerprint rewritten to match
        (
            lambda d: (_patch(d / "tokens.bin", 64 + 4 * 2, struct.pack("<I", 9)), _rewrite_fingerprint(d)),
            r"tokens\.bin: corrupt: token id 9 at position 2 is outside the vocabulary",
        ),
        # a changed token with the old fingerprint
        (
            lambda d: _patch(d / "tokens.bin", 64 + 4 * 2, struct.pack("<I", 4)),
            r"tokens\.bin: corrupt: the token stream does not match the fingerprint",
        ),
        # entry 3 below entry 2
        (
            lambda d: _patch(d / "token_index.bin", 64 + 3 * 8, struct.pack("<Q", 1)),
            r"token_index\.bin: corrupt: entry 3 \(1\) is below entry 2 \(2\)",
        ),
        (
            lambda d: _patch(d / "token_index.bin", 64, struct.pack("<Q", 1)),
            r"token_index\.bin: corrupt: entry 0 is 1, expected 0",
        ),
        # the separator-initial range is one too long
        (
            lambda d: _patch(d / "token_index.bin", 64 + 5 * 8, struct.pack("<Q", 5)),
            r"token_index\.bin: corrupt: entry 5 \(5\) leaves 2 separator-initial suffixes, but the stream has 1",
        ),
        # ranks 0 and 1 ("1 2 3 SEP", "1 2 4") swapped: same first token, out of order
        (
            lambda d: _patch(d / "suffix_array.bin", 64, struct.pack("<II", 4, 0)),
            r"suffix_array\.bin: corrupt: the suffixes at ranks 0 and 1 \(positions 4 and 0\) are out of order",
        ),
        (
            lambda d: _patch(d / "suffix_array.bin", 64, struct.pack("<II", 0, 0)),
            r"suffix_array\.bin: corrupt: entries 0 and 1 both hold position 0",
        ),
        (
            lambda d: _patch(d / "suffix_array.bin", 64 + 4 * 6, struct.pack("<I", 7)),
            r"suffix_array\.bin: corrupt: entry 6 = 7 is outside the stream of 7 tokens",
        ),
    ],
)
def test_corrupt_bodies_are_refused_at_open_naming_file_and_problem(built, corrupt, message):
    corrupt(built)
    with pytest.raises(ValueError, match=message) as e:
        _core.Datastore.open(str(built))
    assert isinstance(e.value, sssd.SSSDError) and str(built) in str(e.value)
    with pytest.raises(sssd.SSSDError, match=message):
        sssd.Datastore.open(built)
    # The check is also callable on a datastore opened without it.
    raw = _core.Datastore.open(str(built), validate=False)
    with pytest.raises(ValueError, match=message):
        raw.validate()


def test_validation_accepts_every_valid_datastore(tmp_path, rng):
    # Long repeats (undecided suffix order within the compared prefix), no
    # separators, sparse huge ids (no token index), a single token.
    streams = [
        random_corpus(rng, 300, vocab=20, repeat=0.9),
        np.tile(np.array([1, 2, 3, 4, 5], dtype=np.uint32), 200),
        np.array([4_000_000_000, 7, SEP, 123_456_789, 7], dtype=np.uint32),
        np.array([3], dtype=np.uint32),
        np.array([SEP, SEP, 1], dtype=np.uint32),
    ]
    for i, tokens in enumerate(streams):
        sssd.Datastore.build(tokens, tmp_path / f"ds{i}")
        for threads in (1, 2):
            _core.Datastore.open(str(tmp_path / f"ds{i}"), num_threads=threads)


def _by_position_order(tokens: list[int]) -> list[int]:
    """The suffix order of datastores written before the separator became one symbol: suffixes
    that reach a separator together are ordered by its position."""

    def key(i):
        out = []
        for p in range(i, len(tokens)):
            if tokens[p] == SEP:
                return tuple(out) + ((2, p),)
            out.append((1, tokens[p]))
        return tuple(out) + ((0,),)

    return sorted(range(len(tokens)), key=key)


def test_older_datastores_with_separators_by_position_still_validate(tmp_path):
    """Documents that end alike: "7 8 SEP" twice. The sort now compares past the separator
    (suffix_order 1 in the suffix array's header); a datastore written before holds them by
    position (0). Each validates under its own order and fails under the other's; an unknown
    order is refused."""
    tokens = [5, 7, 8, SEP, 9, 7, 8, SEP, 3, 7, 8, SEP, 1]
    d = tmp_path / "ds"
    sssd.Datastore.build(np.array(tokens, dtype=np.uint32), d)
    sa = np.fromfile(d / "suffix_array.bin", dtype=np.uint32, offset=64).tolist()
    assert sa == suffix_array(tokens) and (d / "suffix_array.bin").read_bytes()[48] == 1
    old = _by_position_order(tokens)
    assert old != sa, "the two orders differ on this stream"
    tree = _core.Datastore.open(str(d)).query(np.array([7, 8], dtype=np.uint32), _core.DatastoreQuery())

    body = np.array(old, dtype=np.uint32).tobytes()
    _patch(d / "suffix_array.bin", 64, body)
    with pytest.raises(ValueError, match="out of order"):
        _core.Datastore.open(str(d))
    _patch(d / "suffix_array.bin", 48, b"\x00")
    ds = _core.Datastore.open(str(d))  # an older datastore: validates, and drafts the same tree
    again = ds.query(np.array([7, 8], dtype=np.uint32), _core.DatastoreQuery())
    assert tree_to_paths(again) == tree_to_paths(tree)
    _patch(d / "suffix_array.bin", 48, b"\x07")
    with pytest.raises(sssd.SSSDError, match="unknown suffix order 7"):
        _core.Datastore.open(str(d))


def test_repeated_entries_inside_long_repeats_are_found(tmp_path):
    # A 200-token document three times: the suffixes at 400, 200 and 0 have
    # adjacent ranks and share 200 tokens, more than validation compares, so
    # their order is left undecided. Rank of 0 rewritten to 400: no adjacent
    # pair is out of order or equal, but 400 now appears twice.
    doc = list(range(1, 201))
    sssd.Datastore.build(np.array(doc * 3, dtype=np.uint32), tmp_path / "ds")
    sa = np.fromfile(tmp_path / "ds" / "suffix_array.bin", dtype=np.uint32, offset=64)
    r = int(np.flatnonzero(sa == 0)[0])
    assert sa[r - 2 : r + 1].tolist() == [400, 200, 0]
    _patch(tmp_path / "ds" / "suffix_array.bin", 64 + 4 * r, struct.pack("<I", 400))
    with pytest.raises(
        ValueError, match=rf"suffix_array\.bin: corrupt: position 400 appears twice \(again at rank {r}\)"
    ):
        _core.Datastore.open(str(tmp_path / "ds"), num_threads=1)


# --- data files that are not regular files ---------------------------------


def test_a_fifo_in_place_of_a_data_file_is_refused_without_blocking(built):
    # Opening a FIFO for reading waits for a writer: the open must not.
    os.remove(built / "suffix_array.bin")
    os.mkfifo(built / "suffix_array.bin")
    code = textwrap.dedent("""
        import sys
        from sssd import _core
        try:
            _core.Datastore.open(sys.argv[1])
        except _core.SSSDError as e:
            print(e)
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(built)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("opening a datastore with a FIFO for a data file blocked")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "suffix_array.bin: it is a FIFO, not a regular file" in proc.stdout
    with pytest.raises(sssd.DatastoreError, match="FIFO"):  # in process too, now that it cannot block
        sssd.Datastore.open(built)
    os.remove(built / "token_index.bin")
    os.mkdir(built / "token_index.bin")
    os.remove(built / "suffix_array.bin")
    sssd.Datastore.build(np.array([1, 2, 3, SEP, 1, 2, 4], dtype=np.uint32), built.parent / "again")
    os.replace(built.parent / "again" / "suffix_array.bin", built / "suffix_array.bin")
    with pytest.raises(sssd.DatastoreError, match="token_index.bin: it is a directory"):
        sssd.Datastore.open(built)


def test_suffix_rank_is_bounds_checked(built):
    ds = sssd.Datastore.open(built)
    assert sorted(ds.native.suffix(r) for r in range(ds.size)) == list(range(ds.size))
    for bad in (ds.size, ds.size + 1, 2**40):
        with pytest.raises(IndexError, match="out of range"):
            ds.native.suffix(bad)
    with pytest.raises(TypeError):
        ds.native.suffix(-1)
