"""A request's own acceptance by source (sssd.source_evidence) and the merge's per-request factors."""

from __future__ import annotations

import numpy as np
import pytest

import sssd
from sssd.source_evidence import MAX_SOURCES, EvidenceSettings, SourceEvidence
from sssd.sources import DraftPipeline, DraftRequest, RetrievalSource
from sssd.tree import DraftBatch


# -- a brute-force reference ------------------------------------------------------------------
def reference_counts(steps, settings: EvidenceSettings) -> np.ndarray:
    """The evidence of one request, node by node: steps are (tree, factors [S, 2], next tokens)."""
    counts = np.zeros((4, MAX_SOURCES))
    decay = 0.5 ** (1.0 / settings.half_life)
    for tree, factors, tokens in steps:
        n = len(tree.tokens)
        if not n or not len(tokens):
            continue

        def path(j):
            out = []
            while j >= 0:
                out.append(int(tree.tokens[j]))
                j = int(tree.parents[j])
            return out[::-1]

        add = np.zeros((4, MAX_SOURCES))
        for j in range(n):
            p, s, d = int(tree.parents[j]), int(tree.sources[j]), int(tree.depths[j])
            if d > len(tokens):
                continue
            if p >= 0 and path(p) != [int(t) for t in tokens[: d - 1]]:
                continue  # its parent was wrong
            if p >= 0 and int(tree.sources[p]) != s:
                continue
            score = float(tree.scores[j])
            if p < 0:
                expected = score / float(factors[s, 0])
            else:
                expected = score / (float(tree.scores[p]) * float(factors[s, 1]))
                if min(expected, 1.0) < settings.level_floor:
                    continue
            right = path(j) == [int(t) for t in tokens[:d]]
            k = 0 if p < 0 else 2
            add[k, s] += right
            add[k + 1, s] += min(expected, 1.0)
        counts = counts * decay + add
    return counts


def random_batch(rng, sizes, vocab=4, sources=(0, 1, 2, 15)) -> DraftBatch:
    """Random trees: each node under a random earlier one (or the root), siblings' tokens distinct."""
    toks, pars, deps, scores, srcs, offsets = [], [], [], [], [], [0]
    for n in sizes:
        t, p, d, sc, so = [], [], [], [], []
        for j in range(n):
            for _ in range(20):
                parent = int(rng.integers(-1, j)) if j else -1
                taken = {t[k] for k in range(j) if p[k] == parent}
                free = [x for x in range(vocab) if x not in taken]
                if free:
                    break
            else:
                continue
            t.append(int(rng.choice(free)))
            p.append(parent)
            d.append(1 if parent < 0 else d[parent] + 1)
            base = 1.0 if parent < 0 else sc[parent]
            sc.append(base * float(rng.uniform(0.05, 1.0)))
            so.append(int(rng.choice(sources)) if parent < 0 or rng.random() < 0.2 else so[parent])
        toks += t
        pars += p
        deps += d
        scores += sc
        srcs += so
        offsets.append(offsets[-1] + len(t))
    m = len(toks)
    return DraftBatch(
        offsets=np.array(offsets, np.int64),
        tokens=np.array(toks, np.int64),
        parents=np.array(pars, np.int32),
        depths=np.array(deps, np.int32),
        scores=np.array(scores, np.float32),
        sources=np.array(srcs, np.uint8),
        draft_probs=np.full(m, np.nan, np.float32),
    )


@pytest.mark.parametrize("seed", range(4))
def test_evidence_counts_match_a_node_by_node_reference(seed):
    rng = np.random.default_rng(seed)
    settings = EvidenceSettings(half_life=5.0, level_floor=0.3)
    ev = SourceEvidence(settings)
    R = 5
    lengths = {r: int(rng.integers(1, 10)) for r in range(R)}
    for r in range(R):
        ev.open(r, lengths[r])
    history = {r: [] for r in range(R)}
    for _ in range(12):
        ids = [r for r in range(R) if rng.random() < 0.8]
        if not ids:
            continue
        factors = ev.factors(ids)
        batch = random_batch(rng, [int(rng.integers(0, 14)) for _ in ids])
        ev.drafted(ids, [lengths[r] for r in ids], batch, factors)
        nexts = [rng.integers(0, 4, int(rng.integers(0, 6))) for _ in ids]
        ev.extended(ids, nexts)
        for k, r in enumerate(ids):
            history[r].append((batch[k], factors[k], nexts[k]))
            lengths[r] += len(nexts[k])
    for r in range(R):
        np.testing.assert_allclose(ev.counts(r), reference_counts(history[r], settings), rtol=1e-6, atol=1e-9)


def test_a_source_that_keeps_being_right_is_trusted_more_and_one_that_fails_less():
    ev = SourceEvidence(EvidenceSettings(prior=1.0))
    ev.open(7, 3)
    for step in range(20):
        # source 2 proposes the next token at odds 0.3 and is right; source 0 at 0.3 and wrong
        batch = DraftBatch(
            offsets=np.array([0, 2], np.int64),
            tokens=np.array([step, 1000 + step], np.int64),
            parents=np.array([-1, -1], np.int32),
            depths=np.array([1, 1], np.int32),
            scores=np.array([0.3, 0.3], np.float32),
            sources=np.array([2, 0], np.uint8),
            draft_probs=np.full(2, np.nan, np.float32),
        )
        factors = ev.factors([7])
        ev.drafted([7], [3 + step], batch, factors)
        ev.extended([7], [np.array([step])])
    f = ev.factors([7, 8])  # 8 is not open: no correction
    lo, hi = ev.settings.scale_bounds
    assert f[0, 2, 0] > 2.0 and f[0, 2, 0] <= hi
    assert f[0, 0, 0] < 0.6 and f[0, 0, 0] >= lo
    assert f[0, 1, 0] == 1.0 and f[0, 1, 1] == 1.0  # a source that drafted nothing: the calibration
    np.testing.assert_array_equal(f[1], np.ones((MAX_SOURCES, 2), np.float32))


def test_a_tree_is_scored_only_by_the_tokens_that_follow_the_context_it_was_drafted_for():
    ev = SourceEvidence()
    ev.open(1, 5)
    tree = DraftBatch(
        offsets=np.array([0, 1], np.int64),
        tokens=np.array([4], np.int64),
        parents=np.array([-1], np.int32),
        depths=np.array([1], np.int32),
        scores=np.array([0.5], np.float32),
        sources=np.array([0], np.uint8),
        draft_probs=np.full(1, np.nan, np.float32),
    )
    ev.drafted([1], [4], tree, None)  # drafted for a context one token shorter: not kept
    ev.extended([1], [np.array([4])])
    assert not ev.counts(1).any()
    ev.drafted([1], [6], tree, None)
    ev.extended([1], [np.array([], np.int64)])  # nothing new: the tree waits
    ev.extended([1], [np.array([4, 2])])
    assert ev.counts(1)[0, 0] == 1.0 and ev.counts(1)[1, 0] == pytest.approx(0.5)
    ev.extended([1], [np.array([4])])  # no tree pending any more: nothing counted, nothing decayed
    assert ev.counts(1)[0, 0] == 1.0
    ev.close(1)
    ev.extended([1], [np.array([4])])  # closed: ignored
    assert 1 not in ev


def test_bad_settings_are_refused():
    for kw in ({"prior": 0}, {"half_life": -1}, {"level_floor": 2}, {"scale_bounds": (2.0, 4.0)}):
        with pytest.raises(ValueError):
            EvidenceSettings(**kw)


# -- the merge's factors (C++) -----------------------------------------------------------------
def _input_drafter():
    return sssd.Drafter(None, sssd.DrafterConfig(use_datastore=False, copy_max_branch_len=0, budget=64))


def test_source_factors_scale_each_priority_by_scale_and_level_per_depth():
    text = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 1, 2]
    d = _input_drafter()
    d.open(0, text)
    plain = d.draft([0], 200)[0]
    f = np.ones((1, MAX_SOURCES, 2), np.float32)
    f[0, 1] = (0.5, 0.8)  # the input source
    got = d.draft([0], 200, source_factors=f)[0]

    def paths(t):
        out = {}
        for j in range(len(t.tokens)):
            p, k = [], j
            while k >= 0:
                p.append(int(t.tokens[k]))
                k = int(t.parents[k])
            out[tuple(p[::-1])] = float(t.scores[j])
        return out

    a, b = paths(plain), paths(got)
    assert a.keys() == b.keys() and len(a) > 3
    for path, score in a.items():
        assert b[path] == pytest.approx(score * 0.5 * 0.8 ** (len(path) - 1), rel=1e-5)
    # another source's factors leave it as it was
    f2 = np.ones((1, MAX_SOURCES, 2), np.float32)
    f2[0, 0] = (0.1, 0.1)
    np.testing.assert_array_equal(d.draft([0], 200, source_factors=f2)[0].scores, plain.scores)


@pytest.mark.parametrize(
    "factors",
    [
        np.ones((2, MAX_SOURCES, 2), np.float32),  # two rows for one request
        np.ones((1, MAX_SOURCES, 3), np.float32),
        np.ones((1, MAX_SOURCES - 1, 2), np.float32),
        np.full((1, MAX_SOURCES, 2), np.nan, np.float32),
        np.full((1, MAX_SOURCES, 2), -1.0, np.float32),
        np.full((1, MAX_SOURCES, 2), np.inf, np.float32),
    ],
)
def test_bad_source_factors_are_a_clear_error(factors):
    d = _input_drafter()
    d.open(0, [1, 2, 3, 1, 2])
    with pytest.raises(ValueError, match="source_factors|source factors"):
        d.draft([0], 8, source_factors=factors)
    assert len(d.draft([0], 8)[0]) > 0  # the drafter goes on


# -- in the pipeline ------------------------------------------------------------------------------
def test_a_pipeline_corrects_a_request_by_what_its_own_drafts_got():
    """A text that repeats itself with a twist: the input source's first guesses keep failing at the
    twist and the request learns; the trees it drafts change, the tokens it is given do not."""
    rng = np.random.default_rng(3)
    phrase = rng.integers(0, 50, 12).tolist()
    cfg = sssd.DrafterConfig(use_datastore=False, copy_max_branch_len=0, budget=16)
    pipes = {
        on: DraftPipeline([RetrievalSource(None)], cfg, evidence=EvidenceSettings() if on else None) for on in (0, 1)
    }
    text = phrase * 2
    for p in pipes.values():
        p.open(0, text)
    for step in range(30):
        nxt = np.array(phrase[step % 12 : step % 12 + 1] if step % 3 else [99], np.int64)
        for p in pipes.values():
            p.draft([DraftRequest(0, np.array(text), 16)])
            p.extend_batch([0], [nxt])
        text += nxt.tolist()
    assert pipes[0].evidence is None
    c = pipes[1].evidence.counts(0)
    assert c[1, 1] > 0  # the input source's first guesses were counted
    assert pipes[1].evidence.factors([0])[0, 1, 0] != 1.0
    for p in pipes.values():
        p.close(0)
    assert len(pipes[1].evidence) == 0
