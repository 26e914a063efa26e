"""The Drafter API: batching, request lifecycle, bad input, threads, the GIL."""

import os
import threading
import time

import numpy as np
import pytest
from conftest import random_corpus
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import merge, tree_to_paths, trie_continuations

import sssd
from sssd import _core


@pytest.fixture(scope="module")
def store():
    return sssd.Datastore.from_tokens(random_corpus(np.random.default_rng(5), 300, vocab=30))


def test_batch_draft_equals_single_drafts(store):
    rng = np.random.default_rng(0)
    d = sssd.Drafter(store, budget=16)
    prompts = [rng.integers(0, 30, int(rng.integers(1, 40))) for _ in range(40)]
    for i, p in enumerate(prompts):
        d.open(i, p)
    budgets = rng.integers(0, 40, len(prompts))
    batch = d.draft(list(range(len(prompts))), budgets)
    assert len(batch) == len(prompts)
    for i, p in enumerate(prompts):
        one = d.draft_prefix(p, int(budgets[i]))
        tree = batch[i]
        assert len(tree) <= budgets[i]
        np.testing.assert_array_equal(tree.tokens, one.tokens)
        np.testing.assert_array_equal(tree.parents, one.parents)
        np.testing.assert_array_equal(tree.scores, one.scores)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 400),
    vocab=st.sampled_from([2, 5, 30]),
    max_match=st.integers(1, 8),
    branch=st.integers(1, 24),
    budget=st.sampled_from([1, 7, 32, 100]),
)
def test_one_shot_drafts_equal_a_request_tries_drafts(store, seed, n, vocab, max_match, branch, budget):
    """draft_prefix builds the input source by one scan of the context instead of a request
    trie: the trees must be the trie's, for repetitive and varied contexts alike."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, n)
    d = sssd.Drafter(store, input_max_match=max_match, input_branch_len=branch)
    d.open(0, prompt)
    want, got = d.draft([0], budget)[0], d.draft_prefix(prompt, budget)
    for name in ("tokens", "parents", "scores", "sources", "match_lens"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


def test_a_per_call_config_drafts_as_a_drafter_built_with_it(store):
    """draft(config=...) (the calibration entry of a step's budget) gives the trees a drafter
    made with that config gives; a config deeper than the request tries is refused."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 30, int(rng.integers(2, 50))) for _ in range(24)]
    base = sssd.DrafterConfig(budget=16)
    other = base.replace(
        datastore_branch_len=5,
        input_branch_len=7,
        datastore_max_match=6,
        min_occurrences=3,
        discounts=sssd.DiscountParams(input=sssd.SourceDiscount(scale=0.2)),
    )
    d, ref = sssd.Drafter(store, base), sssd.Drafter(store, other)
    for i, p in enumerate(prompts):
        d.open(i, p)
        ref.open(i, p)
    ids = list(range(len(prompts)))
    got, want, own = d.draft(ids, 24, config=other), ref.draft(ids, 24), d.draft(ids, 24)
    for name in ("offsets", "tokens", "parents", "scores", "sources"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert not np.array_equal(own.scores, got.scores)  # the override really applied
    with pytest.raises(ValueError, match="input tries of depth"):
        d.draft(ids, 24, config=base.replace(input_branch_len=60))
    with pytest.raises(ValueError, match="no n-grams"):
        sssd.Drafter(store, base, use_input=False).draft([], 4, config=base)


def test_one_and_two_threads_draft_identical_trees_for_a_large_batch(store):
    """The OpenMP split of a batch (groups of requests per thread) must not change any tree."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 30, int(rng.integers(1, 60))) for _ in range(192)]
    budgets = rng.integers(0, 64, len(prompts))
    external = sssd.tree.concat(
        [
            sssd.DraftTree(
                rng.integers(0, 30, 3),
                np.array([-1, 0, 0], np.int32),
                np.array([1, 2, 2], np.int32),
                np.ones(3, np.float32),
                np.full(3, 2, np.uint8),
                np.full(3, 0.5, np.float32),
            )
            for _ in prompts
        ]
    )
    out = []
    for threads in (1, 2):
        d = sssd.Drafter(store, budget=16, num_threads=threads)
        for i, p in enumerate(prompts):
            d.open(i, p)
        out.append(d.draft(list(range(len(prompts))), budgets, external=external))
    for name in ("offsets", "tokens", "parents", "depths", "scores", "sources", "draft_probs"):
        np.testing.assert_array_equal(getattr(out[0], name), getattr(out[1], name), err_msg=name)
    assert out[0].tokens.size > 1000


def test_extend_equals_reopen(store):
    rng = np.random.default_rng(1)
    d = sssd.Drafter(store)
    prompt, gen = rng.integers(0, 30, 20), rng.integers(0, 30, 25)
    d.open(1, prompt)
    for k in range(0, 25, 4):
        d.extend(1, gen[k : k + 4])
    d.open(2, np.concatenate([prompt, gen]))
    np.testing.assert_array_equal(d.context(1), d.context(2))
    a, b = d.draft([1, 2], 24)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.parents, b.parents)


def test_draft_equals_algorithm_1_on_the_sources(store):
    """End to end: the drafter's tree == reference merge of the reference sources."""
    cfg = sssd.DrafterConfig(
        budget=20, datastore_max_match=3, input_max_match=3, datastore_branch_len=4, input_branch_len=4
    )
    d = sssd.Drafter(store, cfg)
    rng = np.random.default_rng(3)
    ctx = rng.integers(0, 30, 30).tolist()
    got = d.draft_prefix(ctx)
    native_ds = store.query(ctx, max_match=3, max_samples=100, min_occurrences=20, branch_len=4)
    trees = []
    if native_ds["match_len"]:
        trees.append(
            {
                "paths": tree_to_paths(native_ds),
                "total": native_ds["total"],
                "source": 0,
                "match_len": native_ds["match_len"],
                "max_depth": 4,
            }
        )
    for L in range(3, 0, -1):
        paths, total = trie_continuations(ctx, L, 3 + 4)
        if paths:
            trees.append({"paths": paths, "total": total, "source": 1, "match_len": L, "max_depth": min(4, 7 - L)})
    table = cfg.discounts.score_table(3, 4)
    want = merge(trees, lambda s, m, dd: table(s, m, dd), 20)
    assert got.tokens.tolist() == [w[0] for w in want]
    assert got.parents.tolist() == [w[1] for w in want]
    assert got.sources.tolist() == [w[4] for w in want]


def test_input_source_alone_copies_repeated_text():
    d = sssd.Drafter(None, budget=8)
    text = [10, 11, 12, 13, 14, 15, 1, 2, 10, 11, 12]
    tree = d.draft_prefix(text)
    assert tree.chain_tokens().tolist()[:3] == [13, 14, 15]
    assert set(tree.sources.tolist()) == {sssd.SOURCE_INPUT}


def test_external_source_carries_draft_probs(store):
    d = sssd.Drafter(store, budget=6)
    d.open(0, [1, 2, 3])
    ext = sssd.tree.concat(
        [
            sssd.DraftTree(
                tokens=np.array([900, 901]),
                parents=np.array([-1, 0], dtype=np.int32),
                depths=np.array([1, 2], dtype=np.int32),
                scores=np.zeros(2, np.float32),
                sources=np.full(2, 2, np.uint8),
                draft_probs=np.array([0.9, 0.8], np.float32),
            )
        ]
    )
    tree = d.draft([0], 6, external=ext)[0]
    i = tree.tokens.tolist().index(900)
    assert tree.sources[i] == sssd.SOURCE_EXTERNAL and tree.draft_probs[i] == pytest.approx(0.9)
    j = tree.tokens.tolist().index(901)
    assert tree.parents[j] == i and tree.scores[j] == pytest.approx(0.72, rel=1e-5)
    assert np.isnan(tree.draft_probs[tree.sources != sssd.SOURCE_EXTERNAL]).all()


def test_request_lifecycle(store):
    d = sssd.Drafter(store)
    with d.request(5, [1, 2, 3]) as rid:
        assert rid in d and len(d) == 1 and d.request_memory(5) > 0
    assert 5 not in d and len(d) == 0
    d.open(7, [1])
    with pytest.raises(ValueError, match="already open"):
        d.open(7, [2])
    d.close(7)
    with pytest.raises(KeyError, match="unknown request id 7"):
        d.close(7)


# --- bad input ------------------------------------------------------------


@pytest.mark.parametrize(
    "prefix, exc, msg",
    [
        ([], ValueError, "empty"),
        ([1, -3], ValueError, "negative"),
        ([1, 2**32], ValueError, "exceeds"),
        ([1.0, 2.0], TypeError, "integers"),
        ("hello", TypeError, "sequence of token ids"),
        ([[1, 2]], TypeError, "1-D"),
        ([True, False], TypeError, "integers"),
    ],
)
def test_bad_prefixes(store, prefix, exc, msg):
    with pytest.raises(exc, match=msg):
        sssd.Drafter(store).draft_prefix(prefix)


def test_ids_outside_the_vocabulary(store):
    d = sssd.Drafter(store, vocab_size=30)
    with pytest.raises(ValueError, match=r"prefix\[1\] = 31 is outside the vocabulary"):
        d.draft_prefix([1, 31])
    d.open(0, [1, 2])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        d.extend(0, [29, 30])
    with pytest.raises(ValueError, match="reserved"):
        sssd.Drafter(store).draft_prefix([sssd.SEPARATOR])


def test_a_datastore_with_ids_outside_the_vocabulary_is_refused(store):
    # Drafts copy the datastore's ids: they must fit the model's vocabulary.
    assert store.native.vocab_size == 30
    with pytest.raises(
        ValueError, match=r"datastore holds token ids up to 29, outside the vocabulary \(vocab_size 20\)"
    ):
        sssd.Drafter(store, vocab_size=20)
    sssd.Drafter(store, vocab_size=20, use_datastore=False)  # not drafted from: fine
    sssd.Drafter(store, vocab_size=30)


@pytest.mark.parametrize("budget", [-1, 10**6])
def test_bad_budgets(store, budget):
    d = sssd.Drafter(store)
    d.open(0, [1, 2])
    with pytest.raises(ValueError, match="budget"):
        d.draft([0], budget)
    with pytest.raises(ValueError, match="budget"):
        d.draft_prefix([1, 2], budget)
    with pytest.raises(ValueError, match="budget"):
        sssd.DrafterConfig(budget=budget)


def test_budget_zero_gives_empty_draft(store):
    assert len(sssd.Drafter(store).draft_prefix([1, 2, 3], 0)) == 0


def test_unknown_and_bad_request_ids(store):
    d = sssd.Drafter(store)
    d.open(1, [1])
    with pytest.raises(KeyError, match="unknown request id 2"):
        d.draft([1, 2], 4)
    with pytest.raises(KeyError):
        d.extend(3, [1])
    with pytest.raises(ValueError, match=">= 0"):
        d.draft([-1], 4)
    with pytest.raises(TypeError):
        d.open("a", [1])
    with pytest.raises(ValueError, match="budgets"):
        d.draft([1], [4, 4])


def test_bad_config_values():
    with pytest.raises(ValueError, match="input_max_match"):
        sssd.DrafterConfig(input_max_match=0)
    with pytest.raises(ValueError, match="max_samples"):
        sssd.DrafterConfig(max_samples=0)
    with pytest.raises(TypeError, match="must be an int"):
        sssd.DrafterConfig(budget=3.5)
    with pytest.raises(ValueError, match="unknown drafter config fields"):
        sssd.DrafterConfig.from_dict({"bogus": 1})


def test_config_roundtrip(tmp_path):
    cfg = sssd.DrafterConfig(budget=12, discounts=sssd.DiscountParams(input=sssd.SourceDiscount(scale=0.3)))
    cfg.save(tmp_path / "c.json")
    assert sssd.DrafterConfig.load(tmp_path / "c.json") == cfg


def test_a_fifo_in_place_of_a_drafter_config_is_refused_without_being_read(tmp_path):
    # Opening a FIFO for reading waits for a writer that never comes: load checks the file
    # (stat, then an open that cannot block) before reading, so this returns at once.
    os.mkfifo(tmp_path / "c.json")
    with pytest.raises(ValueError) as e:
        sssd.DrafterConfig.load(tmp_path / "c.json")
    assert str(e.value) == f"{tmp_path / 'c.json'}: cannot read a drafter config (it is a FIFO, not a regular file)"


def test_default_datastore_missing_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("SSSD_DATASTORE", str(tmp_path / "none"))
    with pytest.raises(FileNotFoundError, match="sssd build --default"):
        sssd.draft([1, 2, 3])


def test_sssd_draft_with_a_datastore_path(small_datastore_dir, words):
    tokens, _ = words
    ctx = tokens[:10]
    assert sssd.SEPARATOR not in ctx
    tree = sssd.draft(ctx, budget=10, datastore=small_datastore_dir)
    assert 0 < len(tree) <= 10
    assert sssd.draft(ctx, budget=10, datastore=str(small_datastore_dir)).tokens.tolist() == tree.tokens.tolist()
    with pytest.raises(ValueError, match="separator"):
        sssd.draft(np.array([1, sssd.SEPARATOR], dtype=np.uint32), datastore=small_datastore_dir)


# --- concurrency ------------------------------------------------------------


def test_concurrent_threads_open_extend_draft_close(store):
    d = sssd.Drafter(store, budget=16)
    errors = []

    def worker(w):
        try:
            rng = np.random.default_rng(w)
            for r in range(30):
                rid = w * 1000 + r
                d.open(rid, rng.integers(0, 30, 10))
                for _ in range(5):
                    tree = d.draft([rid], 16)[0]
                    assert len(tree) <= 16
                    d.extend(rid, rng.integers(0, 30, 3))
                d.close(rid)
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(d) == 0


def test_drafting_releases_the_gil():
    """A heartbeat thread keeps ticking while a long batch drafts in C++."""
    rng = np.random.default_rng(9)
    store = sssd.Datastore.from_tokens(random_corpus(rng, 3000, vocab=50, max_len=80))
    d = sssd.Drafter(store, budget=64, num_threads=1)
    n = 400
    for i in range(n):
        d.open(i, rng.integers(0, 50, 200))
    ids, budgets = np.arange(n), np.full(n, 64)
    t0 = time.perf_counter()
    d.draft(ids, budgets)
    single = time.perf_counter() - t0
    reps = max(1, int(0.3 / max(single, 1e-4)))

    ticks = 0
    stop = threading.Event()

    def beat():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    hb = threading.Thread(target=beat)
    hb.start()
    t0 = time.perf_counter()
    for _ in range(reps):
        d.draft(ids, budgets)
    elapsed = time.perf_counter() - t0
    stop.set()
    hb.join()
    # With the GIL held for the whole call, the heartbeat could tick at most
    # once per call; released, it ticks about once per millisecond.
    assert ticks > max(3 * reps, elapsed * 1000 * 0.2)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    steps=st.lists(st.integers(0, 6), min_size=1, max_size=12),
    max_match=st.integers(1, 8),
    min_occ=st.sampled_from([0, 3, 50]),
)
def test_stepwise_drafting_equals_drafting_from_scratch(seed, steps, max_match, min_occ):
    """Drafting a request step by step (trie extended incrementally) gives the
    same trees as drafting each context from scratch."""
    rng = np.random.default_rng(seed)
    tokens = random_corpus(rng, 60, vocab=6, repeat=0.6)
    store = sssd.Datastore.from_tokens(tokens)
    d = sssd.Drafter(store, budget=12, datastore_max_match=max_match, min_occurrences=min_occ)
    # follow a real document for a while, so extensions keep matching
    docs = [x for x in " ".join(map(str, tokens.tolist())).split(str(sssd.SEPARATOR)) if x.strip()]
    doc = [int(x) for x in docs[int(rng.integers(len(docs)))].split()]
    ctx = doc[:1]
    d.open(0, ctx)
    for k in steps:
        nxt = doc[len(ctx) : len(ctx) + k] if len(ctx) < len(doc) else rng.integers(0, 6, k).tolist()
        if nxt:
            d.extend(0, nxt)
            ctx = ctx + nxt
        a = d.draft([0], 12)[0]
        b = d.draft_prefix(ctx, 12)
        assert a.tokens.tolist() == b.tokens.tolist()
        assert a.parents.tolist() == b.parents.tolist()
        np.testing.assert_array_equal(a.scores, b.scores)


# --- array layouts at the boundary ------------------------------------------


def _misaligned(values, dtype) -> np.ndarray:
    """A C-contiguous array whose data starts one byte off its natural alignment."""
    values = np.asarray(values, dtype=dtype)
    buf = np.zeros(values.nbytes + 1, dtype=np.uint8)
    out = buf[1:].view(dtype) if values.size else np.zeros(0, dtype)
    out[:] = values
    assert values.size == 0 or not out.flags.aligned
    return out


def test_misaligned_arrays_are_read_safely(store):
    # Reading uint32/uint64/int32 in place from a misaligned buffer is
    # undefined behaviour (UBSan: misaligned load in check_tokens); the
    # binding copies such arrays once. Results equal the aligned ones.
    prompt = [1, 2, 3, 1, 2]
    d = sssd.Drafter(store)
    d.open(7, _misaligned(prompt, np.uint32))
    d.extend(7, _misaligned([3], np.uint32))
    d.open(8, prompt + [3])
    ids = _misaligned([7, 8], np.uint64)
    budgets = _misaligned([8, 8], np.int32)
    external = sssd.tree.concat(
        [
            sssd.DraftTree(
                np.array([4, 5]),
                np.array([-1, 0], np.int32),
                np.array([1, 2], np.int32),
                np.zeros(2, np.float32),
                np.full(2, 2, np.uint8),
                np.array([0.9, 0.8], np.float32),
            )
        ]
        * 2
    )
    got = d._native.draft(
        ids,
        budgets,
        {
            "offsets": _misaligned(external.offsets, np.int64),
            "tokens": _misaligned(external.tokens, np.uint32),
            "parents": _misaligned(external.parents, np.int32),
            "probs": _misaligned(external.draft_probs, np.float32),
        },
    )
    want = d.draft([8, 8], [8, 8], external=external)
    for key in ("offsets", "tokens", "parents", "depths", "scores"):
        np.testing.assert_array_equal(got[key], getattr(want, key))
    assert (
        d.draft_prefix(_misaligned(prompt + [3], np.uint32), 8).tokens.tolist()
        == d.draft_prefix(prompt + [3], 8).tokens.tolist()
    )
    off, nodes = _core.best_chains(
        _misaligned(want.offsets, np.int64), _misaligned(want.parents, np.int32), _misaligned(want.scores, np.float32)
    )
    np.testing.assert_array_equal(nodes, want.best_chains()[1])


# --- request ids ----------------------------------------------------------------


def test_request_ids_are_the_integers_from_0_to_2_64_everywhere(store):
    big, top = 2**63, 2**64 - 1
    d = sssd.Drafter(store)
    for rid in (0, 5, big, top):
        d.open(rid, [1, 2, 3])
    assert d.request_ids() == [0, 5, big, top]
    assert big in d and top in d and -1 not in d and 2**64 not in d
    want = d.draft([5], 8)[0]
    # Every spelling of the ids: lists (mixing >= 2^63 and small ids too),
    # numpy uint64 of both C spellings ('L' and 'Q'), int64, numpy scalars.
    spellings = (
        [big],
        [top, 5],
        [5, big, 0],
        np.array([big], dtype=np.uint64),
        np.asarray([big]),
        np.array([5], dtype=np.int64),
        np.array([5], dtype=np.uint8),
        np.uint64(top),
        [np.uint64(big)],
    )
    for ids in spellings:
        batch = d.draft(ids, 8)
        assert len(batch) == np.asarray(ids).size
        for tree in batch:
            assert tree.tokens.tolist() == want.tokens.tolist()
    d.extend_batch([big, top], [[4], [4, 5]])
    d.extend(np.uint64(big), [6])
    assert d.context(big).tolist() == [1, 2, 3, 4, 6] and d.context(top).tolist() == [1, 2, 3, 4, 5]
    assert d.request_memory(top) > 0
    d.close(big)
    assert big not in d

    native = d._native  # the binding follows the same rule
    native.open(big, np.array([1, 2], dtype=np.uint32))
    assert big in native and native.context(big).tolist() == [1, 2]
    assert len(native.draft(np.asarray([big, top]), np.array([4, 4], dtype=np.int32))["offsets"]) == 3
    native.close(big)

    for bad in (-1, 2**64, -(2**63)):
        for call in (
            lambda: d.open(bad, [1]),
            lambda: d.draft([bad], 4),
            lambda: d.close(bad),
            lambda: native.open(bad, np.array([1], dtype=np.uint32)),
            lambda: native.close(bad),
            lambda: d.extend_batch([0, bad], [[1], [1]]),
        ):
            with pytest.raises(ValueError, match=r"request ids must be >= 0 and < 2\^64, got"):
                call()
    with pytest.raises(ValueError, match="got -1"):
        native.draft(np.array([-1], dtype=np.int64), np.array([4], dtype=np.int32))
    for bad in (1.5, "a", True, None):
        with pytest.raises(TypeError):
            d.open(bad, [1])
        with pytest.raises(TypeError):
            native.open(bad, np.array([1], dtype=np.uint32))
    with pytest.raises(TypeError):
        d.draft([1.5, 2.5], 4)


def test_draft_a_text_with_the_datastores_own_tokenizer(tmp_path, monkeypatch):
    """sssd.draft("text") tokenizes with the tokenizer the datastore records (tokenizers, not
    transformers), gives the same tree as the ids, and renders its tokens as text."""
    import json

    from test_builder_support import conversations, make_tokenizer

    from sssd.cli import main
    from sssd.tokenizer import load_tokenizer

    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path / "cache"))
    tok = make_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "c.json").write_text(json.dumps(conversations(60)))
    assert main(["build", str(tmp_path / "c.json"), "-o", str(tmp_path / "ds"), "-t", str(tok)]) == 0
    ds = sssd.Datastore.open(tmp_path / "ds")
    text = ds.load_tokenizer().decode(ds.tokens[:12].tolist())  # a prefix of a real document
    by_text = sssd.draft(text, budget=12, datastore=ds)
    ids = load_tokenizer(tok).encode(text)
    by_ids = sssd.draft(ids, budget=12, datastore=ds)
    assert len(by_text) > 0 and np.array_equal(by_text.tokens, by_ids.tokens)
    assert np.array_equal(by_text.parents, by_ids.parents)
    words = by_text.token_texts()
    assert len(words) == len(by_text) and all(isinstance(w, str) for w in words)
    assert by_text.text(len(by_text) - 1) and "'" in by_text.format(max_paths=3)  # branches shown as text
    with pytest.raises(ValueError, match="tokenizer"):
        sssd.draft("some text", datastore=None)


def test_drafting_from_text_needs_no_torch_or_transformers(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, sssd\n"
        "ds = sssd.Datastore.from_tokens(np.array([3, 4, 5, 3, 4, 6], dtype=np.uint32))\n"
        "sssd.draft([3, 4], datastore=ds)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
