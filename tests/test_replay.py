"""The replay simulator: known MAT on hand-made drafts, and agreement with a
naive step-by-step replay of the real drafter."""

import numpy as np
import pytest
from conftest import random_corpus

import sssd
from sssd.calibration.replay import Example, accepted_lengths, matched_nodes, replay


class ScriptedDrafter:
    """Drafts, for every request, the true next `k` tokens plus one wrong sibling
    at depth 1: the replay must accept exactly k per step."""

    def __init__(self, outputs, k):
        self.outputs, self.k, self.pos = outputs, k, {}

    def open(self, rid, prompt):
        self.pos[int(rid)] = 0

    def extend_batch(self, rids, chunks):
        for r, c in zip(rids, chunks):
            self.pos[int(r)] += len(c)

    def close(self, rid):
        del self.pos[int(rid)]

    def draft(self, rids, budget):
        trees = []
        for r in rids:
            out, p = self.outputs[int(r)], self.pos[int(r)]
            truth = list(out[p : p + self.k])
            tokens = truth + [10_000]  # a wrong sibling of the first node
            parents = list(range(-1, len(truth) - 1)) + [-1]
            depths = list(range(1, len(truth) + 1)) + [1]
            n = len(tokens)
            trees.append(
                sssd.DraftTree(
                    np.array(tokens),
                    np.array(parents, np.int32),
                    np.array(depths, np.int32),
                    np.ones(n, np.float32),
                    np.zeros(n, np.uint8),
                    np.full(n, np.nan, np.float32),
                )
            )
        return sssd.tree.concat(trees)


def test_known_mat_on_hand_made_drafts():
    outputs = [np.arange(10), np.arange(100, 107)]
    ex = [Example(np.array([1, 2]), o) for o in outputs]
    res = replay(ScriptedDrafter(outputs, 2), ex, budget=3)
    # 10 tokens in steps of 2 accepted + 1 bonus: 3, 3, 3, 1 -> 4 steps; 7 tokens: 3, 3, 1 -> 3 steps.
    assert res.steps == 7 and res.tokens == 17
    assert res.mat == pytest.approx(17 / 7)
    assert res.per_example_mat == pytest.approx([10 / 4, 7 / 3])
    # depth 1 and 2 accepted at every step except the last step of each (1 token left: accepts 1? no: 0)
    assert res.accepted_per_depth[1] == 7 - 0 and res.accepted_per_depth[2] == 5


def test_nothing_accepted_gives_mat_one():
    outputs = [np.arange(5)]
    res = replay(ScriptedDrafter(outputs, 0), [Example(np.array([7]), outputs[0])], budget=4)
    assert res.steps == 5 and res.mat == 1.0


def naive_replay(drafter, examples, budget):
    """One request at a time, drafting from scratch each step."""
    steps = tokens = 0
    for ex in examples:
        ctx, pos = list(ex.prompt), 0
        while pos < len(ex.output):
            tree = drafter.draft_prefix(ctx, budget)
            best = 0
            for i in range(len(tree)):
                path = tree.path(i)
                if list(ex.output[pos : pos + len(path)]) == path:
                    best = max(best, len(path))
            adv = min(best + 1, len(ex.output) - pos)
            ctx += list(ex.output[pos : pos + adv])
            pos += adv
            steps += 1
            tokens += adv
    return steps, tokens


@pytest.mark.parametrize("budget", [1, 8, 24])
def test_batched_replay_equals_naive_replay(budget):
    rng = np.random.default_rng(budget)
    tokens = random_corpus(rng, 200, vocab=20, repeat=0.5)
    store = sssd.Datastore.from_tokens(tokens)
    docs = [d for d in np.split(tokens, np.flatnonzero(tokens == sssd.SEPARATOR) + 1) if len(d) > 12]
    examples = [Example(d[:6].astype(np.int64), d[6:-1].astype(np.int64)) for d in docs[:25]]
    res = replay(sssd.Drafter(store), examples, budget, batch_size=7)
    assert (res.steps, res.tokens) == naive_replay(sssd.Drafter(store), examples, budget)
    assert res.tokens == sum(len(e.output) for e in examples)


def test_matched_nodes_flags_whole_matching_paths():
    # tree: 5 -> 6 -> 7, 5 -> 9, 8 ; target continues 5 6 8
    t = sssd.DraftTree(
        np.array([5, 6, 7, 9, 8]),
        np.array([-1, 0, 1, 0, -1], np.int32),
        np.array([1, 2, 3, 2, 1], np.int32),
        np.ones(5, np.float32),
        np.zeros(5, np.uint8),
        np.full(5, np.nan, np.float32),
    )
    batch = sssd.tree.concat([t, t])
    m = matched_nodes(batch, [np.array([0, 5, 6, 8]), np.array([5, 9])], np.array([1, 0]))
    assert m.tolist() == [True, True, False, False, False, True, False, False, True, False]
    assert accepted_lengths(batch, m).tolist() == [2, 2]


def test_empty_examples_is_an_error():
    with pytest.raises(ValueError, match="no examples"):
        replay(ScriptedDrafter([], 1), [], 4)
