"""How much better could drafts rank? The candidates' ceiling and a learned ranker, beside SSSD.

Issue 15 asks for 1.3x SuffixDecoding's MAT at budget 16. This asks what is
left on the table with SSSD's own candidates (the datastore's backoff tree
and the request trie's trees at input match lengths 4..1):

* **ceiling** (chain oracle): at every step the longest prefix of the true
  continuation found in the union of the candidate trees, capped at the
  budget. No ranking of these candidates can accept more.
* **learned**: the candidates ranked by a gradient-boosted model of
  P(child correct | parent correct) (features per source holding the parent:
  the child's and the parent's counts, its share, its rank among siblings,
  the source's match length; the depth and the number of candidates),
  fitted on the development split, the tree grown best first by the product
  of those probabilities (the expected accepted length is the sum of the
  nodes' path probabilities, so best-first is optimal for calibrated ones).
  Needs scikit-learn (not an SSSD dependency: `pip install scikit-learn`);
  without it, the learned row is skipped.
* **SSSD calibrated**: the packaged calibration, by the same replay.

All by exact greedy replay, one request at a time, on the evaluation splits
(the learned ranker is fitted on the development split). Pure Python beside
the core's queries: minutes per set.

Usage:
  .venv/bin/python benchmarks/bench_ranking.py --sets sharegpt-heldout mtbench gsm8k humaneval
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import load_sets  # noqa: E402
from common import Recorder, machine  # noqa: E402

import sssd  # noqa: E402
from sssd import _core  # noqa: E402
from sssd.calibration.replay import replay  # noqa: E402
from sssd.config import DrafterConfig  # noqa: E402

CALIBRATION = Path(__file__).resolve().parents[1] / "sssd" / "data" / "calibration-smollm2.json"


class Tree:
    """One source's candidate tree as child maps (node -1 is the root)."""

    def __init__(self, kind: int, d: dict, match: int):
        self.kind, self.match, self.total = kind, match, float(d["total"])
        self.weight = d["weights"]
        self.children: dict[int, dict[int, int]] = {}
        for i, (t, p) in enumerate(zip(d["tokens"].tolist(), d["parents"].tolist())):
            self.children.setdefault(p, {})[t] = i

    def w(self, node: int) -> float:
        return self.total if node < 0 else float(self.weight[node])


class Request:
    """A request's candidate sources: the datastore's tree and the input trie's (match 4..1)."""

    def __init__(self, ds, query, prompt, input_match: int = 4, input_branch: int = 16):
        self.ds, self.q, self.input_match = ds, query, input_match
        self.trie = _core.RequestTrie(input_match + input_branch)
        self.ctx = np.asarray(prompt, dtype=np.uint32)
        self.trie.extend(self.ctx)

    def extend(self, tokens) -> None:
        tokens = np.asarray(tokens, dtype=np.uint32)
        self.trie.extend(tokens)
        self.ctx = np.concatenate([self.ctx, tokens])

    def trees(self) -> list[Tree]:
        out = []
        d = self.ds.query(np.ascontiguousarray(self.ctx[-self.q.max_match :]), self.q)
        if d["total"] > 0 and len(d["tokens"]):
            out.append(Tree(0, d, int(d["match_len"])))
        for length in range(min(self.input_match, len(self.ctx)), 0, -1):
            d = self.trie.continuations(length)
            if d["total"] > 0 and len(d["tokens"]):
                out.append(Tree(1, d, length))
        return out


def candidates(members) -> dict[int, list]:
    """The union's children of a node held by `members` [(tree, node)]: token -> its members."""
    out: dict[int, list] = {}
    for tree, node in members:
        for tok, child in tree.children.get(node, {}).items():
            out.setdefault(tok, []).append((tree, child))
    return out


def truth_depth(trees, truth, cap: int) -> int:
    members, d = [(t, -1) for t in trees], 0
    while d < min(len(truth), cap):
        members = [(t, c) for t, n in members if (c := t.children.get(n, {}).get(int(truth[d]))) is not None]
        if not members:
            break
        d += 1
    return d


def _source(tree, node, token):
    ch = tree.children.get(node, {})
    n = tree.w(node)
    c_node = ch.get(token)
    c = tree.w(c_node) if c_node is not None else 0.0
    rank = sum(1 for k in ch.values() if tree.w(k) > c) if c_node is not None else len(ch)
    return [1.0, n, len(ch), c, c / n if n > 0 else 0.0, rank, tree.match]


def features(members, token, depth: int, ncand: int) -> list[float]:
    ds = next(((t, n) for t, n in members if t.kind == 0), None)
    ins = sorted(((t, n) for t, n in members if t.kind == 1), key=lambda tn: -tn[0].match)
    f = [float(depth), float(ncand)]
    f += _source(*ds, token) if ds else [0.0] * 7
    f += _source(*ins[0], token) if ins else [0.0] * 7
    f += _source(*ins[-1], token)[3:5] if ins else [0.0, 0.0]
    return f


def training_rows(trees, truth, cap: int = 64):
    """Every candidate child of each union node on the true path, labelled correct or not."""
    X, y = [], []
    members = [(t, -1) for t in trees]
    for d in range(1, min(len(truth), cap) + 1):
        cands = candidates(members)
        if not cands:
            break
        want = int(truth[d - 1])
        for tok in cands:
            X.append(features(members, tok, d, len(cands)))
            y.append(float(tok == want))
        if want not in cands:
            break
        members = cands[want]
    return X, y


def draft_learned(trees, prob, budget: int, cap: int = 64):
    """Best first over the union by the product of the model's conditional probabilities."""
    heap, order, out = [], 0, []

    def push(members, parent, score, depth):
        nonlocal order
        cands = candidates(members)
        if not cands or depth > cap:
            return
        items = list(cands.items())
        ps = prob(np.array([features(members, t, depth, len(items)) for t, _ in items]))
        for (tok, mem), p in zip(items, ps):
            order += 1
            heapq.heappush(heap, (-score * p, order, tok, parent, depth, mem))

    push([(t, -1) for t in trees], -1, 1.0, 1)
    while heap and len(out) < budget:
        neg, _, tok, parent, depth, mem = heapq.heappop(heap)
        out.append((tok, parent, depth))
        push(mem, len(out) - 1, -neg, depth + 1)
    return out


def accepted(nodes, truth) -> int:
    ok, best = set(), 0
    for i, (tok, parent, depth) in enumerate(nodes):
        if depth <= len(truth) and tok == truth[depth - 1] and (parent < 0 or parent in ok):
            ok.add(i)
            best = max(best, depth)
    return best


def replay_python(ds, query, examples, budget: int, policy) -> float:
    """Exact greedy replay, one request at a time; policy(trees, truth) -> accepted tokens."""
    steps = tokens = 0
    for ex in examples:
        r = Request(ds, query, ex.prompt)
        out, pos = np.asarray(ex.output), 0
        while pos < len(out):
            acc = policy(r.trees(), out[pos:])
            adv = min(acc + 1, len(out) - pos)
            r.extend(out[pos : pos + adv])
            pos += adv
            steps += 1
            tokens += adv
    return tokens / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["sharegpt-heldout", "mtbench", "gsm8k", "humaneval"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--limit", type=int, default=100, help="examples per split")
    ap.add_argument("--calibration", default=str(CALIBRATION))
    args = ap.parse_args()
    try:
        from sklearn.ensemble import HistGradientBoostingClassifier
    except ImportError:
        HistGradientBoostingClassifier = None
        print("scikit-learn is not installed: the learned ranker is skipped (pip install scikit-learn)")
    ds = sssd.Datastore.open("default")
    sets, notes = load_sets(
        ds,
        argparse.Namespace(
            sets=args.sets, groundtruth=[], gt_model="smollm2-135m-instruct", dev_fraction=0.25, limit=args.limit
        ),
    )
    for n in notes:
        print(n)
    query = DrafterConfig().native_params(ds.vocab_size).datastore
    rec = Recorder("ranking", vars(args))
    for es in sets:
        prob = None
        if HistGradientBoostingClassifier is not None and es.dev:
            t0 = time.perf_counter()
            X, y = [], []
            for ex in es.dev:
                r, out = Request(ds.native, query, ex.prompt), np.asarray(ex.output)
                for pos in range(len(out)):
                    a, b = training_rows(r.trees(), out[pos:])
                    X += a
                    y += b
                    r.extend(out[pos : pos + 1])
            model = HistGradientBoostingClassifier(max_iter=200, max_leaf_nodes=31).fit(np.array(X), np.array(y))
            prob = lambda Z, m=model: m.predict_proba(Z)[:, 1]  # noqa: E731
            print(
                f"{es.name}: learned ranker fitted on {len(es.dev)} dev examples, {len(y):,} candidates "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
        for sub, examples in es.evals.items():
            if not examples:
                continue
            for b in args.budgets:
                cfg = DrafterConfig.load(args.calibration, budget=b).replace(budget=b)
                row = {
                    "set": sub,
                    "budget": b,
                    "examples": len(examples),
                    "sssd_calibrated": round(replay(sssd.Drafter(ds, cfg), examples, b).mat, 4),
                    "ceiling": round(
                        replay_python(ds.native, query, examples, b, lambda trees, truth: truth_depth(trees, truth, b)),
                        4,
                    ),
                }
                if prob is not None:
                    row["learned"] = round(
                        replay_python(
                            ds.native,
                            query,
                            examples,
                            b,
                            lambda trees, truth: accepted(draft_learned(trees, prob, b), truth),
                        ),
                        4,
                    )
                rec.add(**row)
                share = (row["sssd_calibrated"] - 1) / max(row["ceiling"] - 1, 1e-9)
                print(
                    f"{sub:22s} b={b:<3d} SSSD calibrated {row['sssd_calibrated']:.3f}  learned "
                    f"{row.get('learned', float('nan')):.3f}  ceiling {row['ceiling']:.3f}  "
                    f"(SSSD takes {share:.0%} of the ceiling's accepted tokens)",
                    flush=True,
                )
    print(f"machine: {machine()}; records: {rec.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
