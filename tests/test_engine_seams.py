"""The engine's seams: draft sources, the backend's packing/acceptance/compaction, incremental text.

Each piece is checked against a brute-force reference (the per-node walks the engine
used to do in Python), and the whole engine against plain decoding: whatever plugs
in, greedy output stays token-identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import tiny_model

import sssd
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams
from sssd.serving.verify.acceptance import Sampler, accept_greedy, accept_sampled
from sssd.serving.verify.tree_batch import pack, pack_chain, stack
from sssd.sources import Candidates, DraftSource, parse_specs
from sssd.tree import DraftBatch, ancestor_mask, concat

PROMPTS = [[5, 9, 23, 7, 3, 40, 41, 42, 3], [10, 11, 12, 13, 10, 11, 12], [4] * 20, [60], [7, 8, 9, 7, 8, 9, 7, 8]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("seams") / "llama", "llama")


@pytest.fixture(scope="module")
def plain_outputs(llama):
    eng = LLMEngine(llama, datastore=None, draft=[], config=EngineConfig(max_model_len=256))
    return [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))]


# -- random trees and brute-force references ------------------------------------------------------------


def random_drafts(rng, B, max_nodes=20, vocab=12) -> DraftBatch:
    trees = []
    for _ in range(B):
        n = int(rng.integers(0, max_nodes + 1))
        parents, tokens, depths, kids = [], [], [], {}
        for i in range(n):
            p = int(rng.integers(-1, i)) if i else -1
            used = kids.setdefault(p, set())
            free = [t for t in range(vocab) if t not in used]
            if not free:
                break
            t = int(rng.choice(free))
            used.add(t)
            parents.append(p)
            tokens.append(t)
            depths.append(1 if p < 0 else depths[p] + 1)
        m = len(tokens)
        trees.append(
            sssd.DraftTree(
                np.array(tokens, np.int64),
                np.array(parents, np.int32),
                np.array(depths, np.int32),
                np.ones(m, np.float32),
                np.zeros(m, np.uint8),
                np.full(m, np.nan, np.float32),
            )
        )
    return concat(trees)


def brute_greedy(tree, argmax_of):
    """The engine's old per-node walk: follow the child holding the target's argmax."""
    children = [dict() for _ in range(len(tree) + 1)]
    for k, (tok, par) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
        children[par + 1][tok] = k + 1
    path, cur = [], 0
    while True:
        nxt = children[cur].get(int(argmax_of(cur)))
        if nxt is None:
            return path, int(argmax_of(cur))
        path.append(nxt)
        cur = nxt


def test_packed_mask_equals_the_per_tree_ancestor_masks(rng):
    for _ in range(20):
        B = int(rng.integers(1, 7))
        drafts = random_drafts(rng, B)
        cached = rng.integers(0, 30, B)
        batch = pack(rng.integers(0, 12, B), cached, drafts)
        vis = batch.visible()
        for b in range(B):
            tree, n, c = drafts[b], 1 + len(drafts[b]), int(cached[b])
            assert vis[b, :n, :c].all()  # the whole cached context
            assert (vis[b, :n, c : c + n] == ancestor_mask(tree.parents)).all()  # exactly its ancestors
            assert not vis[b, :n, c + n :].any()
            for i in range(n, batch.shape[1]):  # padding sees only itself
                assert np.flatnonzero(vis[b, i]).tolist() == [c + i]
            assert (batch.positions[b, 1:n] == c + tree.depths).all() and batch.positions[b, 0] == c


def test_a_prompt_chunk_stacked_under_the_trees_leaves_every_row_as_it_was(rng):
    """stack(): a decode step's trees and prompt chunks in one batch; each row sees exactly what it
    saw alone, and the wider side's padding neither sees nor is seen by anything else."""
    for _ in range(20):
        B, P = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        trees = pack(rng.integers(0, 12, B), rng.integers(0, 30, B), random_drafts(rng, B))
        chunks = pack_chain(rng.integers(0, 30, P), [rng.integers(0, 12, int(rng.integers(1, 25))) for _ in range(P)])
        both = stack(trees, chunks)
        T = max(trees.shape[1], chunks.shape[1])
        assert both.shape == (B + P, T)
        vis = both.visible()
        for part, rows in ((trees, range(B)), (chunks, range(B, B + P))):
            alone, t = part.visible(), part.shape[1]
            for i, b in enumerate(rows):
                n = int(part.sizes[i])
                assert both.sizes[b] == n and both.cached[b] == part.cached[i]
                assert (both.tokens[b, :n] == part.tokens[i, :n]).all()
                assert (both.positions[b, :n] == part.positions[i, :n]).all()
                assert (both.writes[b, :n] == part.writes[i, :n]).all()
                S = min(alone.shape[2], vis.shape[2])
                assert (vis[b, :n, :S] == alone[i, :n, :S]).all() and not vis[b, :n, S:].any()
                assert not both.valid[b, n:].any()
                c = int(part.cached[i])
                for j in range(n, T):  # padding sees only itself
                    assert np.flatnonzero(vis[b, j]).tolist() == [c + j]
                assert t <= T


def test_greedy_acceptance_equals_the_per_node_walk(rng):
    for _ in range(50):
        B = int(rng.integers(1, 7))
        drafts = random_drafts(rng, B, vocab=4)  # a small vocabulary: long accepted paths
        batch = pack(rng.integers(0, 4, B), np.zeros(B, np.int64), drafts)
        argmax = rng.integers(0, 4, batch.shape)
        acc = accept_greedy(batch, argmax)
        mask = acc.path_mask(batch)
        for b in range(B):
            path, bonus = brute_greedy(drafts[b], lambda i: argmax[b, i])
            assert np.flatnonzero(mask[b]).tolist() == path
            assert acc.count[b] == len(path) and acc.bonus[b] == bonus


def test_sampling_walk_follows_the_drawn_tokens(rng):
    """With one-hot distributions the walk is forced: it must follow exactly those tokens."""
    for _ in range(20):
        B = int(rng.integers(1, 6))
        drafts = random_drafts(rng, B, vocab=4)
        batch = pack(rng.integers(0, 4, B), np.zeros(B, np.int64), drafts)
        forced = rng.integers(0, 4, batch.shape)
        logits = torch.full(batch.shape + (4,), -1e4)
        logits.scatter_(2, torch.from_numpy(forced)[..., None], 0.0)
        rows = np.arange(B)
        samplers = [Sampler(1.0, 0, 1.0, torch.Generator().manual_seed(b)) for b in range(B)]
        acc, errors = accept_sampled(
            batch, rows, samplers, lambda r, i: logits[torch.from_numpy(r), torch.from_numpy(i)], torch.Generator()
        )
        assert errors == [None] * B
        for b in range(B):
            path, bonus = brute_greedy(drafts[b], lambda i: forced[b, i])
            assert acc.count[b] == len(path) and acc.bonus[b] == bonus


def test_compaction_moves_every_accepted_path_in_one_call(llama):
    """KVPool.move against a per-position reference copy."""
    from sssd.serving.backends.kv_cache import KVPool, PoolShape

    pool = KVPool(PoolShape(layers=3, kv_heads=2, head_dim=4, slots=4, capacity=16), torch.float32)
    pool.kv.copy_(torch.randn_like(pool.kv))
    before = pool.kv.clone()
    slots, src, dst = np.array([0, 0, 2, 3]), np.array([5, 9, 7, 3]), np.array([4, 5, 3, 1])
    pool.move(slots, src, dst)
    want = before.clone()
    for s, a, d in zip(slots, src, dst):
        want[:, :, s, :, d] = before[:, :, s, :, a]
    assert torch.equal(pool.kv, want)


# -- the engine with draft sources ----------------------------------------------------------------------


class Oracle(DraftSource):
    """Proposes the plain continuation (known in advance): every candidate should be accepted."""

    name = "oracle"

    def __init__(self, plain, prompts, depth=6):
        self.next = {tuple(p): o for p, o in zip(prompts, plain)}
        self.depth = depth
        self.calls = 0

    def propose(self, requests):
        self.calls += 1
        out = []
        for r in requests:
            toks = r.tokens.tolist()
            cont = None
            for p, o in self.next.items():
                full = list(p) + o
                if full[: len(toks)] == toks:
                    cont = full[len(toks) : len(toks) + min(self.depth, r.budget)]
            if not cont:
                out.append(None)
                continue
            n = len(cont)
            # a chain, plus a wrong sibling at the first level
            out.append(
                Candidates(
                    np.array(cont + [(cont[0] + 1) % 90 + 3]),
                    np.array(list(range(-1, n - 1)) + [-1]),
                    np.array([0.9] * n + [0.1], np.float32),
                )
            )
        return out


def test_a_users_source_plugs_in_and_keeps_greedy_identical(llama, plain_outputs):
    src = Oracle(plain_outputs, PROMPTS)
    eng = LLMEngine(llama, datastore=None, draft=[src], config=EngineConfig(max_model_len=256, budget=8))
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs
    assert src.calls > 0 and eng.metrics.accepted_by_source.get("oracle", 0) > 100
    assert sum(o.stats["steps"] for o in outs) < sum(len(o.token_ids) for o in outs) / 3  # it really drafted


def test_a_users_source_beside_retrieval(llama, plain_outputs):
    eng = LLMEngine(
        llama,
        datastore=None,
        draft=["retrieval", Oracle(plain_outputs, PROMPTS)],
        config=EngineConfig(max_model_len=256, budget=12),
    )
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs


def test_two_users_sources_are_told_apart(llama, plain_outputs):
    """Each source keeps its name in the acceptance counts; the stronger-weighted one leads."""
    good, other = Oracle(plain_outputs, PROMPTS), Oracle(plain_outputs, PROMPTS, depth=2)
    other.name, other.discount = "second", sssd.SourceDiscount(scale=0.5)
    eng = LLMEngine(llama, datastore=None, draft=[good, other], config=EngineConfig(max_model_len=256, budget=8))
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs
    by = eng.metrics.accepted_by_source
    assert by.get("oracle", 0) > by.get("second", 0) >= 0 and set(by) <= {"oracle", "second"}


class Broken(DraftSource):
    name = "broken"

    def __init__(self, how):
        self.how = how

    def propose(self, requests):
        if self.how == "raise":
            raise RuntimeError("the drafter fell over")
        if self.how == "count":
            return []
        bad = {
            "vocab": Candidates(np.array([10**6]), np.array([-1])),
            "shape": Candidates(np.array([[5, 6]]), np.array([-1, 0])),
            "parents": Candidates(np.array([5, 6]), np.array([1, -1])),
            "probs": Candidates(np.array([5]), np.array([-1]), np.array([7.0])),
        }[self.how]
        return [bad for _ in requests]


@pytest.mark.parametrize("how", ["raise", "count", "vocab", "shape", "parents", "probs"])
def test_a_failing_source_costs_only_its_drafts(llama, plain_outputs, how):
    eng = LLMEngine(
        llama, datastore=None, draft=["retrieval", Broken(how)], config=EngineConfig(max_model_len=256, budget=6)
    )
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs
    assert all(o.finish_reason == "length" for o in outs)
    assert eng.metrics.accepted_by_source.get("input", 0) > 0  # retrieval still drafted


def test_draft_nothing_is_plain_decoding(llama, plain_outputs):
    eng = LLMEngine(llama, datastore=None, draft=[], config=EngineConfig(max_model_len=256))
    assert eng.drafting is None and eng.planner.max_budget == 0
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs
    assert all(o.stats["steps"] == len(o.token_ids) for o in outs)


def test_unknown_draft_kinds_are_named_with_the_known_ones():
    with pytest.raises(ValueError, match="retrieval.*model:.*self:streamingllm.*self:snapkv"):
        parse_specs(["retrieval", "ngram"])
    with pytest.raises(ValueError, match="malformed"):
        parse_specs("self:mystery")
    with pytest.raises(ValueError, match="twice"):
        parse_specs("retrieval,retrieval")
    assert parse_specs("") == [] and parse_specs("retrieval, model:qwen") == [("retrieval", ""), ("model", "qwen")]


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 8, 16, 33, 64])
def test_batched_greedy_equals_single_as_requests_join_and_leave(llama, plain_outputs, budget):
    """Requests of different lengths join every few steps and leave when done; each output is
    its plain, single-request output, at every budget."""
    eng = LLMEngine(
        llama, datastore=None, config=EngineConfig(max_model_len=256, budget=budget, max_running=3, prefill_chunk=6)
    )
    lengths = [40, 12, 25, 40, 7]
    ids, done, pending = {}, {}, list(enumerate(PROMPTS))
    while pending or eng.has_unfinished():
        if pending and eng.step_count % 3 == 0:
            i, p = pending.pop(0)
            ids[eng.add_request(p, SamplingParams(max_tokens=lengths[i], ignore_eos=True))] = i
        for out in eng.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
    assert [done[i] for i in range(len(PROMPTS))] == [o[:n] for o, n in zip(plain_outputs, lengths)]


# -- incremental text ---------------------------------------------------------------------------------


def test_incremental_text_equals_full_decoding_and_cuts_at_stop_strings(llama):
    from transformers import AutoTokenizer

    from sssd.serving.engine.detokenizer import Detokenizer

    tok = AutoTokenizer.from_pretrained(llama)
    rng = np.random.default_rng(3)
    for _ in range(20):
        ids = rng.integers(0, 93, 60).tolist()
        d = Detokenizer(tok)
        for t in ids:
            assert not d.add(t)
        assert d.text == tok.decode(ids, skip_special_tokens=True) == d.finish()
    ids = tok.encode("w1 w2 w3 w4 w5 w6", add_special_tokens=False)
    d = Detokenizer(tok, stop=("w4 w5",))
    stopped = [d.add(t) for t in ids]
    assert stopped.index(True) == 4 and d.finish() == "w1 w2 w3 "
