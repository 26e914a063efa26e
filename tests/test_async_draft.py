"""Asynchronous drafting (serving.async_draft): lossless, re-rooting, the draft model's KV, bad drafters.

Greedy: token-identical to plain decoding (float32) with retrieval, with a draft model, and
with both, at several batch sizes, async on every step. Sampling: 3-token continuations
against the target's exact probabilities (chi-square), with trees grown during the step
before in use. Re-rooting against a brute-force reference. The draft model's promoted K/V
(moved, not recomputed) give the q a fresh drafter computes. A drafting thread that
stalls or dies leaves the engine drafting serially (or not at all) without hanging.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch
from sampling_checks import sequence_pvalue
from tiny_models import perturbed_model, tiny_model

import sssd
from sssd.serving.drafting.async_draft import ModeChooser, best, combine, reroot, row_of, union
from sssd.serving.drafting.model_drafter import ModelDrafter
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams
from sssd.sources import Candidates, DraftRequest, DraftSource
from sssd.tree import DraftBatch

PROMPTS = [[5, 9, 23, 7, 3, 40, 41, 42, 3], [10, 11, 12, 13, 10, 11, 12], [4] * 20, [60], [7, 8, 9, 7, 8, 9, 7, 8]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("target") / "llama", "llama")


@pytest.fixture(scope="module")
def near_llama(llama, tmp_path_factory):
    """The target with its weights perturbed: a drafter close to it but not equal (q != p)."""
    return perturbed_model(llama, tmp_path_factory.mktemp("drafter") / "llama")


@pytest.fixture(scope="module")
def plain(llama):
    eng = LLMEngine(llama, datastore=None, draft=[], config=EngineConfig(max_model_len=256))
    return [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))]


def corpus(plain) -> sssd.Datastore:
    """The plain continuations in pieces, some corrupted: retrieval drafts long, partly wrong trees."""
    rng = np.random.default_rng(0)
    docs = []
    for full in plain:
        for _ in range(3):
            a = int(rng.integers(0, len(full) - 6))
            docs.append(full[a : a + int(rng.integers(6, 20))])
            wrong = list(full[a : a + 8])
            wrong[int(rng.integers(2, 8))] = int(rng.integers(3, 93))
            docs.append(wrong)
    return sssd.Datastore.from_tokens(np.array([t for d in docs for t in d + [sssd.SEPARATOR]], dtype=np.uint32))


def async_engine(model, draft, datastore=None, **cfg) -> LLMEngine:
    cfg.setdefault("max_model_len", 256)
    eng = LLMEngine(model, datastore=datastore, draft=draft, config=EngineConfig(draft_mode="async", **cfg))
    eng.mode_chooser = ModeChooser(fixed="async")  # every step async (the measured choice is tested apart)
    return eng


# -- re-rooting against brute force -------------------------------------------------------------


def random_batch(rng, rows: int, n: int) -> DraftBatch:
    """Random trees (parents precede children) with priorities falling along every path."""
    toks, pars, deps, scores, offs = [], [], [], [], [0]
    for _ in range(rows):
        p = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
        t = [int(x) for x in rng.integers(0, 5, n)]  # few tokens: siblings may repeat (the first matches)
        d, sc = [], []
        for i in range(n):
            d.append(1 if p[i] < 0 else d[p[i]] + 1)
            sc.append((1.0 if p[i] < 0 else sc[p[i]]) * float(rng.uniform(0.05, 0.999)))
        toks += t
        pars += p
        deps += d
        scores += sc
        offs.append(offs[-1] + n)
    m = len(toks)
    return DraftBatch(
        np.array(offs, np.int64),
        np.array(toks, np.int64),
        np.array(pars, np.int32),
        np.array(deps, np.int32),
        np.array(scores, np.float32),
        np.full(m, 7, np.uint8),
        np.array(scores, np.float32),
    )


def brute_reroot(drafts: DraftBatch, row: int, path: list[int], budget: int):
    """Every node's token path from the root; the nodes whose path extends `path` (the first node
    matching each step, as a walk finds it), the `budget` of highest score: their paths below."""
    tree = drafts[row]
    paths = []
    for i in range(len(tree.tokens)):
        pth, j = [], i
        while j >= 0:
            pth.insert(0, j)
            j = int(tree.parents[j])
        paths.append(pth)

    def first_child(parent, tok):
        kids = [i for i in range(len(tree.tokens)) if tree.parents[i] == parent and tree.tokens[i] == tok]
        return kids[0] if kids else None

    node = -1
    for tok in path:
        node = first_child(node, tok)
        if node is None:
            return None
    below = [i for i in range(len(tree.tokens)) if node in paths[i][:-1] or (node == -1)]
    below = sorted(below, key=lambda i: -float(tree.scores[i]))[:budget]
    start = len(paths[node]) if node >= 0 else 0
    return sorted(tuple(int(tree.tokens[j]) for j in paths[i][start:]) for i in below)


def test_reroot_keeps_the_best_subtree_below_the_path():
    rng = np.random.default_rng(3)
    for trial in range(200):
        drafts = random_batch(rng, 3, int(rng.integers(1, 30)))
        row = int(rng.integers(0, 3))
        tree = drafts[row]
        # a path that exists (a node's token path) or, sometimes, one that does not
        i = int(rng.integers(0, len(tree.tokens)))
        path = []
        while i >= 0:
            path.insert(0, int(tree.tokens[i]))
            i = int(tree.parents[i])
        path = path[: int(rng.integers(0, len(path) + 1))]
        if trial % 5 == 0:
            path = path + [99]
        budget = int(rng.integers(0, 12))
        got = reroot(drafts, row, path, budget)
        want = brute_reroot(drafts, row, path, budget)
        if want is None:
            assert got is None
            continue
        assert got is not None and len(got["tokens"]) == len(want)
        paths = []
        for j, p in enumerate(got["parents"].tolist()):
            assert p < j
            paths.append((paths[p] if p >= 0 else ()) + (int(got["tokens"][j]),))
            assert got["depths"][j] == len(paths[-1])
        assert sorted(paths) == want


def test_combine_and_row_of_round_trip():
    drafts = random_batch(np.random.default_rng(0), 4, 9)
    back = combine([row_of(drafts, b) for b in range(4)])
    for name in ("offsets", "tokens", "parents", "depths", "scores", "sources", "draft_probs"):
        assert np.array_equal(getattr(back, name), getattr(drafts, name))
    empty = combine([None, row_of(drafts, 1), None])
    assert empty.sizes.tolist() == [0, 9, 0]


def _token_paths(tree: dict) -> dict[tuple, tuple]:
    """Token path from the root -> (score, source) of its node; checks parents precede children
    and depths."""
    paths: list[tuple] = []
    out = {}
    for j, p in enumerate(tree["parents"].tolist()):
        assert p < j
        paths.append((paths[p] if p >= 0 else ()) + (int(tree["tokens"][j]),))
        assert tree["depths"][j] == len(paths[-1])
        assert paths[-1] not in out, "a token path appears twice"
        out[paths[-1]] = (float(tree["scores"][j]), int(tree["sources"][j]))
    return out


def _merged_tree(rng, n: int) -> dict:
    """A random tree as the merge makes them: no two siblings with one token."""
    tree = row_of(random_batch(rng, 1, n), 0)
    seen, keep, index = set(), [], {}
    for j, (p, t) in enumerate(zip(tree["parents"].tolist(), tree["tokens"].tolist())):
        if (p < 0 or p in index) and (p, t) not in seen:
            seen.add((p, t))
            index[j] = len(keep)
            keep.append(j)
    out = {k: v[keep] for k, v in tree.items()}
    out["parents"] = np.array([-1 if p < 0 else index[p] for p in tree["parents"][keep].tolist()], np.int32)
    return out


def test_union_holds_each_path_once_with_its_better_node():
    rng = np.random.default_rng(5)
    for _ in range(200):
        a, b = (_merged_tree(rng, int(rng.integers(1, 20))) for _ in range(2))
        b["sources"] = np.ones_like(b["sources"])  # which tree a node came from
        pa, pb = _token_paths(a), _token_paths(b)
        got = _token_paths(union(a, b))
        assert set(got) == set(pa) | set(pb)
        for path, (score, source) in got.items():
            want = max((v for v in (pa.get(path), pb.get(path)) if v is not None), key=lambda v: v[0])
            assert score == want[0]
            if path in pa and path in pb and pa[path][0] != pb[path][0]:
                assert source == want[1]
        budget = int(rng.integers(1, 12))
        cut = _token_paths(best(union(a, b), budget))
        assert len(cut) == min(budget, len(got))
        assert all(path[:-1] in cut or len(path) == 1 for path in cut)  # closed under parents


def test_a_measured_choice_of_three_arms_runs_the_fastest_and_probes_each_other_in_turn():
    from sssd.serving.planning.measured_choice import MeasuredChoice

    ch = MeasuredChoice(("rule", "always", "never"), block=2, probe_every=4)
    rates = {"rule": 100.0, "always": 80.0, "never": 150.0}
    seen = []
    for _ in range(120):
        a = ch.choose(4)
        seen.append(a)
        ch.observe(4, a, 10 / rates[a], 10)
    assert seen[:6] == ["rule", "rule", "always", "always", "never", "never"]  # each measured, in order
    late = seen[30:]
    assert late.count("never") > 2 * (late.count("rule") + late.count("always"))
    assert late.count("rule") > 0 and late.count("always") > 0  # both probed, not just one
    r = ch.rates()
    assert list(r) == [4] and max(r[4], key=r[4].get) == "never"
    assert ch.choose(16) == "rule"  # another bucket starts with the default
    assert ch.choose(4, "async") == "rule"  # so does another scope: measured apart
    ch.observe(4, "rule", 1.0, 5, "async")
    assert ch.rates()[("async", 4)] == {"rule": 5.0} and set(ch.rates()[4]) == {"rule", "always", "never"}
    with pytest.raises(ValueError, match="two or more"):
        MeasuredChoice(("only",))
    with pytest.raises(ValueError, match="fixed"):
        MeasuredChoice(("a", "b"), fixed="c")


def test_mode_chooser_keeps_the_faster_mode_and_probes_the_other():
    ch = ModeChooser(block=2, probe_every=4)
    rates = {"serial": 100.0, "async": 150.0}
    seen = []
    for _ in range(80):
        m = ch.mode(1)
        seen.append(m)
        ch.observe(1, m, 10 / rates[m], 10)
    assert seen[20:].count("async") > 3 * seen[20:].count("serial") > 0
    rates = {"serial": 150.0, "async": 100.0}  # the machine changed: the probes notice
    for _ in range(200):
        m = ch.mode(1)
        ch.observe(1, m, 10 / rates[m], 10)
    assert ch.rates()[1]["serial"] > ch.rates()[1]["async"]
    assert ch.mode(1) in ("serial", "async") and ModeChooser(fixed="serial").mode(8) == "serial"
    with pytest.raises(ValueError, match="fixed"):
        ModeChooser(fixed="sometimes")


# -- lossless --------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget, running", [(None, 4), (6, 1), (16, 3)])
def test_greedy_is_token_identical_with_retrieval(llama, plain, budget, running):
    eng = async_engine(llama, ["retrieval"], corpus(plain), budget=budget, max_running=running)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain
    a = eng.async_drafter
    assert a.hits > 0, "re-rooted trees were used"
    assert sum(o.stats["accepted"] for o in outs) > 0


@pytest.mark.parametrize("running", [1, 3])
def test_greedy_is_token_identical_with_a_draft_model(llama, near_llama, plain, running):
    src = ModelDrafter(near_llama, target=llama, slots=3, capacity=256, complement=False)
    eng = async_engine(llama, ["retrieval", src], budget=6, max_running=running)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain
    assert eng.async_drafter.hits > 0
    assert eng.metrics.accepted_by_source.get(src.name, 0) > 0


def test_a_model_drafting_for_itself_keeps_its_tree_across_steps(llama, plain):
    """The target drafting for itself: every grown chain is right, so the next root is always in
    the grown tree: it is carried over (K/V moved to the prefix, no catch-up pass)."""
    src = ModelDrafter(llama, slots=1, capacity=256)
    eng = async_engine(llama, [src], budget=4, max_running=1)
    outs = eng.generate(PROMPTS[:2], SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain[:2]
    a = eng.async_drafter
    assert a.misses <= 2 and a.hits >= 10, (a.hits, a.misses)
    assert src.promoted > 30
    steps = outs[0].stats["accepted_per_step"]
    assert np.mean(steps[1:-1]) > 3, steps  # a budget of 4, accepted in full nearly every step


@pytest.mark.parametrize("grown", [False, True])
def test_promoted_kv_gives_the_q_a_fresh_drafter_computes(llama, grown):
    """A drafter whose prefix K/V were moved from its last tree (not recomputed), and under async
    drafting whose grown subtree was carried over and grown further, drafts with the q of one
    that fed the same tokens from scratch."""
    prompt = np.array(PROMPTS[0], dtype=np.int64)
    a, b = ModelDrafter(llama, slots=1, capacity=256), ModelDrafter(llama, slots=1, capacity=256)
    a.open(1, prompt)
    assert a.lag(1) == len(prompt)  # nothing fed yet
    a.grow = (lambda: True) if grown else None
    first = a.propose([DraftRequest(1, prompt, 10)])[0]
    a.grow = None
    assert a.lag(1) == 0
    chain, node = [], -1  # the main chain (the first child at every node): what the target accepts
    while True:
        kids = [i for i in range(len(first.tokens)) if first.parents[i] == node]
        if not kids:
            break
        node = kids[0]
        chain.append(int(first.tokens[node]))
    assert len(chain) >= (5 if grown else 4)
    appended = np.array(chain[:3], dtype=np.int64)
    a.extend(1, appended)
    assert a.promoted == 3 and a.lag(1) == 0  # the appended tokens walked down fed nodes
    tokens = np.concatenate([prompt, appended])
    passes = a.passes
    got = a.propose([DraftRequest(1, tokens, 24)])[0]
    if not grown:  # no catch-up pass: the root's state was kept
        assert a.passes - passes == len(a.expansion) - 1
    b.open(1, tokens)
    want = b.propose([DraftRequest(1, tokens, 24)])[0]
    paths_a = _paths(got)
    hits = 0
    for path, p in _paths(want).items():
        if path in paths_a:
            hits += 1
            assert paths_a[path] == pytest.approx(p, abs=1e-4), path
    assert hits >= 4  # at least the main chain, deeper than what was carried


def _paths(c: Candidates) -> dict[tuple, float]:
    out: dict[tuple, float] = {}
    keys: list[tuple] = []
    for i, (t, p) in enumerate(zip(c.tokens.tolist(), c.parents.tolist())):
        keys.append((keys[p] if p >= 0 else ()) + (t,))
        out[keys[-1]] = float(c.probs[i])
    return out


def three_token_probs(model, prompt, temperature, tops=(5, 3, 2)):
    """p(t1) p(t2 | t1) p(t3 | t1 t2) for the likeliest triples, from Hugging Face's forward pass."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = {}

    def walk(prefix, prob, depth):
        if depth == len(tops):
            out[tuple(prefix[len(prompt) :])] = prob
            return
        with torch.no_grad():
            p = torch.softmax(ref(torch.tensor(prefix)[None]).logits[0, -1] / temperature, -1)
        for t in torch.topk(p, tops[depth]).indices.tolist():
            walk(prefix + [t], prob * float(p[t]), depth + 1)

    walk(list(prompt), 1.0, 0)
    return out


def test_sampled_sequences_follow_the_models_distribution(llama, near_llama):
    """Sampling with a grown tree in use from the second step on: 3-token continuations against the
    target's exact probabilities."""
    temperature, prompt = 0.6, PROMPTS[1]
    joint = three_token_probs(llama, prompt, temperature)
    src = ModelDrafter(near_llama, target=llama, slots=64, capacity=256, expansion=(2, 1), complement=False)
    eng = async_engine(llama, [src], budget=1, max_running=64)  # a second step always
    n = 2000
    outs = eng.generate(
        [prompt] * n, [SamplingParams(max_tokens=3, temperature=temperature, seed=s, ignore_eos=True) for s in range(n)]
    )
    assert eng.async_drafter.hits > n // 10, "grown trees were used"
    assert sum(o.stats["accepted"] for o in outs) > n // 4

    assert sequence_pvalue(outs, joint) > 1e-3
    assert sequence_pvalue(outs, three_token_probs(llama, prompt, temperature * 1.3)) < 1e-3  # the test has power


# -- the switch and bad drafters -------------------------------------------------------------------


def test_draft_mode_is_validated_and_reaches_the_engine(llama):
    with pytest.raises(ValueError, match="draft_mode must be one of serial, async"):
        EngineConfig(draft_mode="parallel")
    with pytest.raises(ValueError, match="draft_threads"):
        EngineConfig(draft_mode="async", draft_threads=0)
    llm = sssd.LLM(llama, datastore=None, draft_mode="async", max_model_len=128)
    assert llm.engine.async_drafter is not None and llm.engine.mode_chooser.fixed is None
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out[0].token_ids) == 8
    assert sssd.LLM(llama, datastore=None, max_model_len=128).engine.async_drafter is None  # serial by default


def test_serve_takes_draft_mode(capsys):
    import importlib

    from sssd.cli import _parser, main

    importlib.import_module("sssd.commands")  # registers the subcommands

    parser = _parser()
    assert parser.parse_args(["serve", "--draft-mode", "async"]).draft_mode == "async"
    assert parser.parse_args(["serve"]).draft_mode == "serial"
    assert main(["serve", "--draft-mode", "sometimes"]) == 1
    assert "--draft-mode: invalid choice: 'sometimes'" in capsys.readouterr().err


class Stalling(DraftSource):
    """Proposes a chain of the request's last tokens; its `stall`-th call from the drafting
    thread sleeps `seconds` (or raises `error`)."""

    name = "stalling"

    def __init__(self, stall: int, seconds: float = 0.0, error: BaseException | None = None):
        self.calls, self.stall, self.seconds, self.error = 0, stall, seconds, error

    def propose(self, requests):
        import threading

        if threading.current_thread().name == "sssd-drafter":
            self.calls += 1
            if self.calls == self.stall:
                if self.error is not None:
                    raise self.error
                time.sleep(self.seconds)
        return [
            Candidates(np.asarray(r.tokens[-3:][::-1], dtype=np.int64), np.arange(-1, 2, dtype=np.int32))
            if len(r.tokens) >= 3
            else None
            for r in requests
        ]


def test_a_stalled_drafting_thread_costs_drafts_not_requests(llama, plain, caplog):
    src = Stalling(stall=3, seconds=2.0)
    eng = async_engine(llama, ["retrieval", src], corpus(plain), budget=6, max_running=2)
    eng.async_drafter.stall_seconds = 0.2
    with caplog.at_level(logging.WARNING, logger="sssd.serving"):
        outs = eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain
    assert eng.async_drafter.stalls >= 1 and "stalled" in caplog.text
    # once the thread came back, drafting went on asynchronously
    time.sleep(2.0)
    hits = eng.async_drafter.hits
    outs = eng.generate(PROMPTS[:2], SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain[:2] and eng.async_drafter.hits > hits


def test_a_dead_drafting_thread_leaves_serial_drafting(llama, plain, caplog):
    src = Stalling(stall=3, error=SystemExit("gone"))
    eng = async_engine(llama, ["retrieval", src], corpus(plain), budget=6, max_running=2)
    with caplog.at_level(logging.ERROR, logger="sssd.serving"):
        outs = eng.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain
    assert eng.async_drafter.dead and "died" in caplog.text
    drafted = eng.metrics.num_drafts
    eng.generate(PROMPTS[:2], SamplingParams(max_tokens=20, ignore_eos=True))
    assert eng.metrics.num_drafts > drafted  # serial drafting goes on
