"""Structure fuzzing of on-disk datastores: a corrupt body never crashes.

A small real datastore is built in tmp_path, then copies of it are corrupted
in ways that checksums cannot catch, because the test rewrites them to match:
every header's fingerprint of the token stream and the manifest's fingerprint
and sha256 of every file. Only structural checks can then tell. Each corrupt
copy is opened (validated, through sssd.Datastore.open; and unvalidated,
through _core.Datastore.open(validate=False), which leans on the bounds-safe
accessors alone) and drafted from under several configurations (with
min_occurrences > max_samples among them, various budgets and P). Each step
must raise a Python exception or give a valid tree: parents precede children,
depths follow parents, ids are inside the vocabulary, siblings are distinct.

The corrupt cases run in child interpreters, so a crash (SIGSEGV, abort) is
reported as a failed case instead of killing the test session; after a crash
the remaining cases continue in a fresh child.

Corruptions: random byte flips in each data file's body; token-index ranges
shifted (monotone, off the text, or wrapping below zero); suffix-array noise
inside [0, n) (swapped pairs, perturbed entries, shuffled and rotated
windows, with and without a shifted index); out-of-vocabulary ids in the
text. Before the drafter was made bounds-safe, random flips of the token and
suffix-array files never crashed it; the structured corruptions did, in
every kind but the byte flips.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import random_corpus

import sssd
from sssd import _core

HEADER = 64
FINGERPRINT_OFFSET = 40  # magic 8, version 4, elem_bytes 4, count 8, vocab_size 8, num_docs 8
VOCAB = 40
DATA_FILES = ("tokens.bin", "suffix_array.bin", "token_index.bin")

KINDS = (
    "flip_tokens",
    "flip_suffix_array",
    "flip_token_index",
    "index_shift",
    "index_shift_off_text",
    "index_shift_wrap",
    "sa_swap",
    "sa_perturb",
    "sa_shuffle_window",
    "sa_rotate_window",
    "sa_swap_and_index_shift",
    "oov_tokens",
    "oov_tokens_huge",
)
CASES_PER_KIND = 12

# Drafter configurations: (DrafterConfig overrides, budgets drafted).
CONFIGS = (
    (dict(max_samples=4, min_occurrences=50), (32, 8)),  # min_occurrences > max_samples: level by level
    (dict(max_samples=2, min_occurrences=1000, datastore_branch_len=4, input_max_match=1), (1, 8)),
    (dict(max_samples=100, min_occurrences=20), (64,)),
    (dict(max_samples=16, min_occurrences=1, input_max_match=8, datastore_max_match=4), (1, 16)),
    (dict(max_samples=50, min_occurrences=0, datastore_branch_len=32, input_max_match=2, end_token=VOCAB - 1), (512,)),
)


# --- corruption (runs in the child) ----------------------------------------


def _read(path: Path, dtype) -> np.ndarray:
    return np.fromfile(path, dtype=dtype, offset=HEADER)


def _write_body(path: Path, body: np.ndarray) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER)
        f.write(body.tobytes())


def _corrupt(d: Path, kind: str, rng: np.random.Generator) -> None:
    """Applies one corruption of `kind`; retries until some byte changed."""
    before = {name: (d / name).read_bytes() for name in DATA_FILES}
    while all((d / name).read_bytes() == data for name, data in before.items()):
        _corrupt_once(d, kind, rng)


def _corrupt_once(d: Path, kind: str, rng: np.random.Generator) -> None:
    tokens = _read(d / "tokens.bin", np.uint32)
    n = tokens.shape[0]
    sa_dtype = np.uint32 if struct.unpack_from("<I", (d / "suffix_array.bin").read_bytes(), 12)[0] == 4 else np.uint64
    sa = _read(d / "suffix_array.bin", sa_dtype)
    index = _read(d / "token_index.bin", np.uint64)

    def shift_index(lo_bound: int, hi_bound: int) -> None:
        a = int(rng.integers(0, index.shape[0]))
        b = int(rng.integers(a + 1, index.shape[0] + 1))
        delta = int(rng.integers(lo_bound, hi_bound))
        index[a:b] = (index[a:b].astype(np.int64) + (delta or 1)).astype(np.uint64)

    if kind.startswith("flip_"):
        name = {
            "flip_tokens": "tokens.bin",
            "flip_suffix_array": "suffix_array.bin",
            "flip_token_index": "token_index.bin",
        }[kind]
        raw = bytearray((d / name).read_bytes())
        for _ in range(int(rng.integers(1, 9))):
            pos = int(rng.integers(HEADER, len(raw)))
            raw[pos] ^= 1 << int(rng.integers(0, 8))
        (d / name).write_bytes(bytes(raw))
        return
    if kind == "index_shift":  # stays inside [0, n], ranges no longer match the text
        shift_index(-8, 9)
        index[:] = np.clip(index.astype(np.int64), 0, n).astype(np.uint64)
    elif kind == "index_shift_off_text":  # ranges pushed past the end of the text
        shift_index(n // 2, n + 50)
    elif kind == "index_shift_wrap":  # below zero: wraps to huge uint64 values
        shift_index(-(n + 50), -1)
    elif kind in ("sa_swap", "sa_swap_and_index_shift"):
        for _ in range(int(rng.integers(1, 40))):
            i, j = rng.integers(0, n, 2)
            sa[i], sa[j] = sa[j], sa[i]
        if kind == "sa_swap_and_index_shift":
            shift_index(-8, 9)
    elif kind == "sa_perturb":
        k = int(rng.integers(1, 40))
        sa[rng.integers(0, n, k)] = rng.integers(0, n, k).astype(sa_dtype)
    elif kind == "sa_shuffle_window":
        a = int(rng.integers(0, n - 1))
        b = min(n, a + int(rng.integers(2, 400)))
        sa[a:b] = rng.permutation(sa[a:b])
    elif kind == "sa_rotate_window":
        a = int(rng.integers(0, n - 1))
        b = min(n, a + int(rng.integers(2, 400)))
        sa[a:b] = np.roll(sa[a:b], int(rng.integers(1, b - a + 1)))
    elif kind in ("oov_tokens", "oov_tokens_huge"):
        real = np.flatnonzero(tokens != sssd.SEPARATOR)
        at = rng.choice(real, size=int(rng.integers(1, 30)), replace=False)
        hi = VOCAB + 1000 if kind == "oov_tokens" else int(_core.MAX_TOKEN_ID) + 1
        lo = VOCAB if kind == "oov_tokens" else hi - 1000
        tokens[at] = rng.integers(lo, hi, at.shape[0]).astype(np.uint32)
    else:
        raise AssertionError(kind)
    _write_body(d / "tokens.bin", tokens)
    _write_body(d / "suffix_array.bin", sa)
    _write_body(d / "token_index.bin", index)


def _rewrite_checksums(d: Path) -> None:
    """Makes every checksum agree with the (corrupt) files, as an attacker or
    a buggy writer that checksums its own output would."""
    tokens = _read(d / "tokens.bin", np.uint32)
    fingerprint = int(_core.stream_stats(tokens)["fingerprint"])
    for name in DATA_FILES:
        with open(d / name, "r+b") as f:
            f.seek(FINGERPRINT_OFFSET)
            f.write(struct.pack("<Q", fingerprint))
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["fingerprint"] = f"{fingerprint:016x}"
    for name in DATA_FILES:
        data = (d / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (d / "manifest.json").write_text(json.dumps(manifest))


# --- drafting and tree checks (run in the child) -----------------------------

ACCEPTED = (ValueError, IndexError, sssd.SSSDError)


def _check_tree(tokens, parents, depths, vocab: int, budget: int | None = None, distinct: bool = True) -> None:
    """A well-formed tree. Draft trees (from the merger) also have distinct
    siblings; a raw continuation tree of a corrupt datastore may not (its
    paths arrive unsorted), which is harmless."""
    tokens = np.asarray(tokens).tolist()
    parents = np.asarray(parents).tolist()
    n = len(tokens)
    assert budget is None or n <= budget, f"{n} nodes exceed the budget {budget}"
    seen = set()
    for i in range(n):
        p = parents[i]
        assert -1 <= p < i, f"parent[{i}] = {p} does not precede its child"
        assert 0 <= tokens[i] < vocab, f"token[{i}] = {tokens[i]} is outside the vocabulary ({vocab})"
        if depths is not None:
            want = 1 if p < 0 else int(depths[p]) + 1
            assert int(depths[i]) == want, f"depth[{i}] = {int(depths[i])}, expected {want}"
        assert not distinct or (p, tokens[i]) not in seen, f"two children of {p} carry token {tokens[i]}"
        seen.add((p, tokens[i]))


def _exercise(ds: sssd.Datastore, contexts: list[list[int]]) -> str:
    """Drafts under every configuration; returns 'ok' or the accepted exception's class."""
    vocab = ds.vocab_size
    try:
        for overrides, budgets in CONFIGS:
            drafter = sssd.Drafter(ds, **overrides)
            for rid, ctx in enumerate(contexts):
                drafter.open(rid, ctx)
            ids = list(range(len(contexts)))
            for budget in budgets:
                batch = drafter.draft(ids, budget)
                for tree in batch:
                    _check_tree(tree.tokens, tree.parents, tree.depths, vocab, budget)
                tree = drafter.draft_prefix(contexts[0], budget)
                _check_tree(tree.tokens, tree.parents, tree.depths, vocab, budget)
            for ctx in contexts[:4]:
                q = ds.query(
                    ctx,
                    max_match=overrides.get("datastore_max_match", 16),
                    max_samples=overrides["max_samples"],
                    min_occurrences=overrides["min_occurrences"],
                    branch_len=overrides.get("datastore_branch_len", 16),
                )
                _check_tree(q["tokens"], q["parents"], None, vocab, distinct=False)
    except ACCEPTED as e:
        return f"raised {type(e).__name__}"
    return "ok"


def _run_case(base: Path, work: Path, case: dict, contexts: list[list[int]]) -> dict:
    d = work / f"case{case['id']}"
    shutil.copytree(base, d)
    try:
        _corrupt(d, case["kind"], np.random.default_rng(case["seed"]))
        _rewrite_checksums(d)
        result = {}
        # Validation at open: the native open names the file and the problem
        # in a ValueError; the public open may re-wrap it (sssd.DatastoreError).
        try:
            _core.Datastore.open(str(d))
        except ACCEPTED as e:
            result["native_open"] = f"raised {'ValueError' if isinstance(e, ValueError) else type(e).__name__}"
            assert any(name in str(e) for name in DATA_FILES) and str(d) in str(e), f"unclear error: {e}"
        else:
            result["native_open"] = "ok"
        try:
            ds = sssd.Datastore.open(d)
        except ACCEPTED as e:
            result["validated"] = f"open raised {type(e).__name__}"
        else:
            result["validated"] = _exercise(ds, contexts)
            del ds
        # Without validation only the bounds-safe accessors stand between the
        # corrupt body and a crash.
        try:
            raw = _core.Datastore.open(str(d), validate=False)
        except ACCEPTED as e:
            result["unvalidated"] = f"open raised {type(e).__name__}"
        else:
            manifest = json.loads((d / "manifest.json").read_text())
            result["unvalidated"] = _exercise(sssd.Datastore(raw, d, manifest), contexts)
        return result
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    base, work = Path(spec["base"]), Path(spec["work"])
    for case in spec["cases"]:
        print(f"START {case['id']}", flush=True)
        try:
            result = _run_case(base, work, case, spec["contexts"])
        except AssertionError as e:
            result = {"invalid": str(e)}
        except Exception as e:  # an exception the API should not raise
            result = {"unexpected": f"{type(e).__name__}: {e}"}
        print("RESULT " + json.dumps({"id": case["id"], **result}), flush=True)


# --- the test ------------------------------------------------------------------


def _run_children(spec: dict, tmp_path: Path) -> tuple[dict[int, dict], list[str]]:
    """Runs every case in child interpreters, restarting after a crash."""
    results: dict[int, dict] = {}
    crashes: list[str] = []
    pending = list(spec["cases"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    while pending:
        spec_path = tmp_path / "spec.json"
        spec_path.write_text(json.dumps({**spec, "cases": pending}))
        proc = subprocess.run(
            [sys.executable, "-c", "import sys, test_datastore_fuzz as m; m._child(sys.argv[1])", str(spec_path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        started = None
        for line in proc.stdout.splitlines():
            if line.startswith("START "):
                started = int(line.split()[1])
            elif line.startswith("RESULT "):
                r = json.loads(line[7:])
                results[r.pop("id")] = r
                started = None
        if proc.returncode != 0:
            if started is None:  # died outside any case: nothing to blame, stop
                raise AssertionError(f"fuzz child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            case = next(c for c in pending if c["id"] == started)
            sig = -proc.returncode
            why = signal.Signals(sig).name if 0 < sig < 65 else f"exit {proc.returncode}"
            crashes.append(
                f"case {started} ({case['kind']}, seed {case['seed']}): {why}; stderr tail: {proc.stderr[-400:]!r}"
            )
            results[started] = {"crashed": why}
        pending = [c for c in pending if c["id"] not in results]
    return results, crashes


def test_corrupt_datastores_raise_or_draft_valid_trees(tmp_path):
    rng = np.random.default_rng(2024)
    tokens = random_corpus(rng, 400, vocab=VOCAB)
    base = tmp_path / "base"
    sssd.Datastore.build(tokens, base, metadata={"tokenizer": {"name": "fuzz", "vocab_size": VOCAB}})
    # Contexts copied from the corpus (so they match, often at length) plus random ones.
    t = tokens.tolist()
    contexts = []
    while len(contexts) < 10:
        a = int(rng.integers(0, len(t) - 20))
        ctx = [x for x in t[a : a + int(rng.integers(1, 20))] if x != sssd.SEPARATOR]
        if ctx:
            contexts.append(ctx)
    contexts += [[int(x) for x in rng.integers(0, VOCAB, k)] for k in (1, 3, 12)]
    cases = [
        {"id": i * CASES_PER_KIND + k, "kind": kind, "seed": 1000 * i + k}
        for i, kind in enumerate(KINDS)
        for k in range(CASES_PER_KIND)
    ]
    work = tmp_path / "work"
    work.mkdir()
    spec = {"base": str(base), "work": str(work), "cases": cases, "contexts": contexts}

    results, crashes = _run_children(spec, tmp_path)

    assert len(results) == len(cases)
    bad = {i: r for i, r in results.items() if "crashed" in r or "invalid" in r or "unexpected" in r}
    by_outcome: dict[str, int] = {}
    for r in results.values():
        for mode in ("native_open", "validated", "unvalidated"):
            if mode in r:
                key = f"{mode}: {r[mode]}"
                by_outcome[key] = by_outcome.get(key, 0) + 1
    print(f"\n{len(cases)} corrupt datastores, each opened 3 ways; outcomes: {json.dumps(by_outcome, sort_keys=True)}")
    assert not crashes, "crashed:\n" + "\n".join(crashes)
    assert not bad, "\n".join(f"case {i} ({cases[i]['kind']}): {r}" for i, r in sorted(bad.items()))
    # Validation at open catches every structured corruption (the corpus has
    # no repeat long enough to hide a misordered pair); byte flips only where
    # they break the structure (a flip in a token can keep it valid).
    for i, r in results.items():
        if not cases[i]["kind"].startswith("flip_"):
            assert r["native_open"] == "raised ValueError", (cases[i], r)
            assert r["validated"].startswith("open raised"), (cases[i], r)
