"""The verifier's device handling, tested on the CPU: what the CUDA path computes differently
(the mask built from the ancestor relation, grouped-query heads folded along the queries, the
split launch/collect) against the CPU path's own results, and the errors for a device that is
not there or a KV pool that does not fit."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from test_engine_seams import PROMPTS, random_drafts
from tiny_models import tiny_model

from sssd.serving.backends import attention, devices
from sssd.serving.backends.torch_backend import TorchBackend, kv_positions, tree_mask
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams
from sssd.serving.verify.tree_batch import pack


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("device") / "llama", "llama")


@pytest.mark.parametrize("seed", range(5))
def test_the_mask_built_from_ancestors_equals_the_packed_mask(seed):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 9))
    batch = pack(rng.integers(0, 50, B), rng.integers(0, 40, B), random_drafts(rng, B))
    S = batch.kv_length
    t = {k: torch.from_numpy(getattr(batch, k)) for k in ("cached", "valid", "ancestors", "writes", "positions")}
    got = tree_mask(t["cached"], t["valid"], t["ancestors"], S)
    assert got.dtype == torch.bool and got.shape == (B, batch.shape[1], S)
    assert np.array_equal(got.numpy(), batch.visible())
    assert np.array_equal(kv_positions(t["writes"], t["positions"], S).numpy(), batch.kv_positions())


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 3), (4, 4)])
def test_folded_grouped_query_attention_equals_attention_per_head(heads, kv_heads):
    rng = np.random.default_rng(heads)
    gen = torch.Generator().manual_seed(heads)
    B, D = 3, 16
    batch = pack(rng.integers(0, 50, B), rng.integers(1, 30, B), random_drafts(rng, B))
    T, S = batch.shape[1], batch.kv_length
    mask = torch.from_numpy(batch.visible())[:, None]
    q = torch.randn(B, heads, T, D, generator=gen)
    k = torch.randn(B, kv_heads, S, D, generator=gen)
    v = torch.randn(B, kv_heads, S, D, generator=gen)
    groups = heads // kv_heads
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask
    )
    bias = attention.fold_mask(mask, groups, q.dtype)
    assert bias.shape == (B, 1, groups * T, S) and bias.stride(-2) % 16 == 0
    got = attention.folded_attention(q, k, v, bias, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_folded_attention_keeps_greedy_identical_through_the_engine(llama):
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = LLMEngine(llama, datastore=None, draft=[], config=EngineConfig(max_model_len=256))
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    eng = LLMEngine(llama, datastore=None, config=EngineConfig(max_model_len=256, budget=8))
    eng.backend.fold_attention = True  # what CUDA runs, here on the CPU
    assert [o.token_ids for o in eng.generate(PROMPTS, params)] == want
    assert eng.metrics.accepted_by_source  # it speculated


def test_launch_then_collect_hands_over_argmax_topk_and_logits(llama):
    """launch only enqueues (on CUDA); collect gives what a one-shot pass gives: the argmax of
    greedy rows, the logits of sampled rows, top-k of both, from the same forward pass."""
    be = TorchBackend(llama, slots=4, capacity=64)
    rng = np.random.default_rng(0)
    drafts = random_drafts(rng, 3, vocab=20)
    batch = pack(rng.integers(3, 90, 3), np.zeros(3, np.int64), drafts)
    greedy = np.array([True, False, True])
    out = be.collect(be.launch(slice(0, 3), batch, greedy, topk=3))
    logits = be.logits(be.hidden_states(slice(0, 3), batch))  # the same pass again: same K/V writes
    ref = logits.argmax(-1).numpy()
    for b in range(3):
        n = int(batch.sizes[b])
        assert (out.argmax[b, n:] == -1).all() and (out.topk[b, n:] == -1).all()
        assert np.array_equal(out.topk[b, :n], logits[b, :n].topk(3, dim=-1).indices.numpy())
        if greedy[b]:
            assert np.array_equal(out.argmax[b, :n], ref[b, :n])
            assert (out.logit_index[b] == -1).all()
        else:
            assert (out.argmax[b] == -1).all()
            torch.testing.assert_close(out.logits[torch.from_numpy(out.logit_index[b, :n])], logits[b, :n])


def test_a_device_that_is_not_here_is_one_clear_error():
    assert devices.resolve(None).type in ("cpu", "cuda")
    assert devices.resolve("cpu") == torch.device("cpu")
    with pytest.raises(devices.DeviceError, match="not a device name"):
        devices.resolve("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(devices.DeviceError, match="'cuda'.*(without CUDA|sees no CUDA GPU)"):
            devices.resolve("cuda")
    else:
        n = torch.cuda.device_count()
        with pytest.raises(devices.DeviceError, match=f"has {n} CUDA GPU"):
            devices.resolve(f"cuda:{n}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_an_engine_on_cuda_without_cuda_fails_at_its_config():
    from sssd import LLM

    with pytest.raises(devices.DeviceError, match="'cuda'"):
        EngineConfig(device="cuda")
    with pytest.raises(devices.DeviceError, match="'cuda'"):
        LLM("no-such-model-is-pulled-first", device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_serve_on_cuda_without_cuda_fails_in_one_line_before_loading(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "sssd.cli", "serve", "--device", "cuda", "--datastore", "none"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "device 'cuda'" in lines[0] and "CUDA" in lines[0], r.stderr
    assert "loading" not in r.stderr


def test_a_kv_pool_that_does_not_fit_says_its_sizes(llama):
    with pytest.raises(
        MemoryError,
        match=r"KV pool: .* GiB \(1048576 slots x 1048576 tokens x 2 layers x 2 KV heads"
        r" x 16 x K and V x 4 bytes\).*--max-running",
    ):
        TorchBackend(llama, slots=2**20, capacity=2**20)


@pytest.mark.parametrize("fold,call_cost", [(False, 0), (False, 16), (False, 10**6), (True, 16)])
def test_a_ragged_pass_computes_what_a_padded_one_does(llama, fold, call_cost, monkeypatch):
    """Trees of unequal size run ragged (the layers over the real tokens only): the same hidden
    states at every real node, the same K/V written for them, as the pass that pads every row."""
    monkeypatch.setattr(attention, "CALL_COST", call_cost)  # 0: split wherever it saves; 1e6: never
    rng = np.random.default_rng(3)
    drafts = random_drafts(rng, 4, vocab=20)
    cached = np.array([5, 0, 9, 3], np.int64)
    batch = pack(rng.integers(3, 90, 4), cached, drafts)
    assert not batch.valid.all()  # rows of unequal size
    got = {}
    for ragged in (False, True):
        be = TorchBackend(llama, slots=4, capacity=64)
        be.fold_attention, be.ragged = fold, ragged
        torch.manual_seed(0)  # the same cached context in both
        be.pool.kv.copy_(torch.randn_like(be.pool.kv))
        hidden = be.hidden_states(slice(0, 4), batch)
        got[ragged] = (hidden[torch.from_numpy(batch.valid)], be.pool.kv.clone())
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-5)
    kv_padded, kv_ragged = got[False][1], got[True][1]
    for b in range(4):  # the real nodes' K/V; padding positions are not written by a ragged pass
        at = slice(int(cached[b]), int(cached[b] + batch.sizes[b]))
        torch.testing.assert_close(kv_ragged[:, :, b, :, at], kv_padded[:, :, b, :, at], rtol=1e-5, atol=1e-5)


def test_ragged_passes_keep_greedy_identical_through_the_engine(llama, monkeypatch):
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("SSSD_RAGGED", flag)
        eng = LLMEngine(llama, datastore=None, config=EngineConfig(max_model_len=256, budget=8))
        assert eng.backend.ragged == (flag == "1")
        runs[flag] = [o.token_ids for o in eng.generate(PROMPTS, params)]
    plain = LLMEngine(llama, datastore=None, draft=[], config=EngineConfig(max_model_len=256))
    assert runs["1"] == runs["0"] == [o.token_ids for o in plain.generate(PROMPTS, params)]


def test_the_split_of_a_ragged_pass_takes_the_long_rows_tails_alone():
    plan = attention.split_plan(np.array([1, 2, 41, 1, 3]), torch.device("cpu"))
    assert plan.width <= 3 and [r for r, *_ in plan.tails] == [2]
    r, j0, j1, q0, keys = plan.tails[0]
    assert (j0, j1, q0, keys) == (1 + 2 + plan.width, 1 + 2 + 41, plan.width, None)
    # every token is in the all-rows call or in a tail, once
    covered = sorted(plan.src.tolist() + [j for _, a, b, *_ in plan.tails for j in range(a, b)])
    assert covered == list(range(48))
    assert attention.split_plan(np.array([5, 5, 4]), torch.device("cpu")) is None  # nearly even: pad


def test_prompt_chunks_beside_trees_attend_alone_and_each_call_reads_only_the_keys_it_sees():
    """A decode pass that also writes prompt chunks (rows from `heads` on): the chunks are whole
    tails, the head call covers the tree rows only, and every call reads keys only as far as its
    queries see (a chunk deep into a long prompt must not make the tree rows read its context)."""
    sizes, cached = np.array([1, 3, 1, 40, 7]), np.array([100, 50, 80, 900, 0])
    plan = attention.split_plan(sizes, torch.device("cpu"), keys=940, cached=cached, heads=3)
    assert plan.rows == 3 and plan.head_keys == max(100 + 1, 50 + plan.width, 80 + 1)
    whole = [(r, j0, j1, q0, keys) for r, j0, j1, q0, keys in plan.tails if r >= 3]
    assert whole == [(3, 5, 45, 0, 940), (4, 45, 52, 0, 7)]
    covered = sorted(plan.src.tolist() + [j for _, a, b, *_ in plan.tails for j in range(a, b)])
    assert covered == list(range(52))
    # even rows still split when chunks follow them
    assert attention.split_plan(np.array([2, 2, 9]), torch.device("cpu"), heads=2).tails[0][0] == 2


def test_a_long_context_splits_where_a_short_one_pads():
    """One row of 16 verifies 2 tokens: padding the other 15 rows to 2 queries costs 15 query rows, a
    second call CALL_COST at a short context and less at a long one (a padded query reads every key)."""
    sizes = np.array([1] * 15 + [2])
    cpu = torch.device("cpu")
    assert attention.split_plan(sizes, cpu) is None and attention.split_plan(sizes, cpu, keys=100) is None
    plan = attention.split_plan(sizes, cpu, keys=700)
    assert plan is not None and plan.width == 1 and [r for r, *_ in plan.tails] == [15]


@pytest.mark.parametrize("ragged", [False, True])
def test_a_short_row_at_the_end_of_its_slot_beside_a_long_tree_stays_inside_it(llama, ragged):
    """Row 0 has 3 positions left in its slot and verifies its root alone; row 1 verifies 19 draft
    nodes: padding row 0 to 20 queries would reach 17 positions past its slot's end (into the next
    slot's K/V). Each row computes what it computes alone, and row 1's cached K/V stay intact."""
    from sssd.tree import DraftBatch, concat

    chain = 19
    drafts = DraftBatch(
        np.array([0, 0, chain]),
        np.arange(10, 10 + chain, dtype=np.int64),
        np.arange(chain, dtype=np.int32) - 1,
        np.arange(1, chain + 1, dtype=np.int32),
        np.ones(chain, np.float32),
        np.zeros(chain, np.uint8),
        np.ones(chain, np.float32),
    )
    cached = np.array([29, 4], np.int64)
    roots = np.array([7, 8])
    be = TorchBackend(llama, slots=2, capacity=32)
    be.ragged = ragged
    torch.manual_seed(0)
    be.pool.kv.copy_(torch.randn_like(be.pool.kv))
    before = be.pool.kv.clone()
    batch = pack(roots, cached, drafts)
    assert batch.kv_length > be.capacity
    both = be.hidden_states(slice(0, 2), batch)
    for b in range(2):
        one = TorchBackend(llama, slots=2, capacity=32)
        one.pool.kv.copy_(before)
        row = concat([drafts[b]]) if b == 1 else None
        alone = one.hidden_states(slice(b, b + 1), pack(roots[b : b + 1], cached[b : b + 1], row))
        n = int(batch.sizes[b])
        torch.testing.assert_close(both[b, :n], alone[0, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(be.pool.kv[:, :, 1, :, :4], before[:, :, 1, :, :4])


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_a_decode_pass_that_writes_prompt_chunks_computes_what_two_passes_do(llama, rows, monkeypatch):
    """launch(heads=B) over B tree rows stacked over prompt chunks: the trees' outputs and every K/V
    written are those of the decode pass and the chunks' own pass; only the tree rows are in the
    attention's head call (the chunks attend alone), whatever the model's K/V head count."""
    from sssd.serving.verify.tree_batch import pack_chain, stack

    rng = np.random.default_rng(rows)
    chunk_rows = 2
    be = TorchBackend(llama, slots=rows + chunk_rows, capacity=96)
    torch.manual_seed(rows)
    be.pool.kv.copy_(torch.randn_like(be.pool.kv))
    before = be.pool.kv.clone()
    cached = rng.integers(5, 60, rows)
    trees = pack(rng.integers(3, 90, rows), cached, random_drafts(rng, rows))
    chunks = pack_chain(np.array([0, 40]), [rng.integers(3, 90, 23), rng.integers(3, 90, 9)])
    seen = []
    plan = attention.split_plan
    monkeypatch.setattr(attention, "split_plan", lambda *a, **k: seen.append(plan(*a, **k)) or seen[-1])
    greedy = np.ones(rows + chunk_rows, dtype=bool)
    fused = be.collect(be.launch(slice(0, rows + chunk_rows), stack(trees, chunks), greedy, heads=rows))
    assert {p.rows for p in seen} == {rows}
    assert fused.argmax.shape[0] == rows
    after = be.pool.kv.clone()

    apart = TorchBackend(llama, slots=rows + chunk_rows, capacity=96)
    apart.pool.kv.copy_(before)
    want = apart.collect(apart.launch(slice(0, rows), trees, greedy[:rows]))
    apart.prefill(slice(rows, rows + chunk_rows), chunks)
    T = trees.shape[1]
    assert (fused.cropped(T).argmax[trees.valid] == want.argmax[trees.valid]).all()
    for b in range(rows):  # the trees' K/V at their write positions, the rest of the slot untouched
        n = int(trees.sizes[b])
        torch.testing.assert_close(after[:, :, b, :, : cached[b] + n], apart.pool.kv[:, :, b, :, : cached[b] + n])
    for i in range(chunk_rows):
        end = int(chunks.cached[i] + chunks.sizes[i])
        torch.testing.assert_close(after[:, :, rows + i, :, :end], apart.pool.kv[:, :, rows + i, :, :end])


def test_prompt_chunks_ride_in_decode_passes_only_where_attention_splits_them_off(llama):
    be = TorchBackend(llama, slots=2, capacity=32)
    assert be.fuses_prefill  # a CPU, ragged passes
    be.fold_attention = True  # folded heads (CUDA's default) attend padded rows
    assert not be.fuses_prefill
    be.fold_attention, be.ragged = None, False
    assert not be.fuses_prefill
