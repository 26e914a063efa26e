"""Suffix-array construction against the brute-force order."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import SEP, suffix_array

import sssd
from sssd import _core

token_lists = st.lists(st.one_of(st.integers(0, 5), st.integers(0, 70_000), st.just(SEP)), min_size=0, max_size=300)


@settings(max_examples=300, deadline=None)
@given(tokens=token_lists, threads=st.sampled_from([1, 2]))
def test_matches_brute_force_order(tokens, threads):
    sa = _core.build_suffix_array(np.array(tokens, dtype=np.uint32), threads)
    assert sa.dtype == np.uint32
    assert sa.tolist() == suffix_array(tokens)


@settings(max_examples=60, deadline=None)
@given(period=st.integers(1, 5), reps=st.integers(1, 120), sep_every=st.integers(0, 50))
def test_highly_repetitive_streams(period, reps, sep_every):
    # Long repeats are the worst case for prefix doubling: ties persist for many rounds.
    tokens = [i % period for i in range(period * reps)]
    if sep_every:
        tokens = [SEP if (i + 1) % sep_every == 0 else t for i, t in enumerate(tokens)]
    sa = _core.build_suffix_array(np.array(tokens, dtype=np.uint32), 2)
    assert sa.tolist() == suffix_array(tokens)


def test_sparse_huge_ids_use_the_compacting_path():
    # Ids far above the stream length take the sort-unique alphabet path.
    rng = np.random.default_rng(0)
    tokens = rng.choice(np.array([5, 4_000_000_000, 3_999_999_999, 17, SEP], dtype=np.uint64), 400).astype(np.uint32)
    sa = _core.build_suffix_array(tokens, 2)
    assert sa.tolist() == suffix_array(tokens.tolist())


def test_real_text_corpus(words):
    tokens, _ = words
    sa = _core.build_suffix_array(tokens, 2)
    # Full brute force is slow on 30k tokens; check sortedness of neighbours instead.
    from reference import suffix_key

    t = tokens.tolist()
    assert sorted(sa.tolist()) == list(range(len(t)))
    for a, b in zip(sa[:-1], sa[1:]):
        assert suffix_key(t, int(a)) < suffix_key(t, int(b))


def test_progress_callback_and_interrupt():
    tokens = np.array([1, 2] * 5000, dtype=np.uint32)
    seen = []
    _core.build_suffix_array(tokens, 2, lambda done, total: seen.append((done, total)))
    assert seen and seen[-1] == (len(tokens), len(tokens))
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))

    def stop(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _core.build_suffix_array(tokens, 2, stop)


def test_rejects_wrong_dtype_without_copying():
    with pytest.raises(TypeError, match="dtype uint32"):
        _core.build_suffix_array(np.array([1, 2, 3], dtype=np.int64))
    with pytest.raises(TypeError, match="1-D"):
        _core.build_suffix_array(np.zeros((2, 2), dtype=np.uint32))
    with pytest.raises(TypeError, match="C-contiguous"):
        _core.build_suffix_array(np.arange(10, dtype=np.uint32)[::2])


def test_empty_and_single():
    assert _core.build_suffix_array(np.zeros(0, dtype=np.uint32)).tolist() == []
    assert _core.build_suffix_array(np.array([sssd.SEPARATOR], dtype=np.uint32)).tolist() == [0]


@pytest.mark.skipif(
    bool(os.environ.get("SSSD_SANITIZED")) or "libasan" in os.environ.get("LD_PRELOAD", ""),
    reason="ASan reserves terabytes of address space: RLIMIT_AS cannot be lowered under it",
)
@pytest.mark.parametrize(
    "stream, room",
    [
        ("np.ones(n, dtype=np.uint32)", 6),  # the symbol copy of the stream does not fit
        ("np.arange(n, dtype=np.uint32)[::-1].copy()", 9),  # it fits, libsais's buckets (n symbols) do not
    ],
)
def test_allocation_failure_inside_the_sort_is_a_memory_error(stream, room):
    # The address-space limit leaves `room` bytes per token above what the
    # interpreter holds: the 4-byte output array always fits. Running out of
    # memory, before libsais or inside it (its work space, allocated within
    # OpenMP regions), must come out as MemoryError, not as a crash. In a
    # child interpreter, so that a regression cannot kill the test session.
    code = textwrap.dedent(f"""
        import resource
        import numpy as np
        from sssd import _core
        n = 1 << 24
        tokens = {stream}
        _core.build_suffix_array(np.ones(1000, dtype=np.uint32), 2)  # OpenMP threads (stacks) exist first
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
        limit = used + {room} * n
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            _core.build_suffix_array(tokens, 2)
        except MemoryError:
            print("MemoryError")
        else:
            print("sorted")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.strip() == "MemoryError"
