// TreeMerger against a naive Algorithm 1.
//
// The reference keeps every candidate in one list and takes the best by the
// merger's full order (priority, then shallower, then lower tree index,
// token and parent): the merger's pop order must be the same although it
// queues each sorted sibling list one entry at a time. Source trees are
// random eager trees with random weights; discounts are random.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "sssd/continuation_tree.h"
#include "sssd/draft_tree.h"
#include "sssd/score_table.h"
#include "sssd/tree_merger.h"

namespace sssd {
namespace {

struct RefNode {
  token_t token;
  int32_t parent, depth;
  float score;
  uint8_t source;
};

std::vector<RefNode> reference_merge(const std::vector<SourceTree>& trees, const ScoreTable& table, int budget) {
  struct Cand {
    double priority;
    int32_t depth;
    uint32_t tree;
    token_t token;
    int32_t parent;
    uint32_t node;
  };
  auto better = [](const Cand& a, const Cand& b) {
    if (a.priority != b.priority) return a.priority > b.priority;
    if (a.depth != b.depth) return a.depth < b.depth;
    if (a.tree != b.tree) return a.tree < b.tree;
    if (a.token != b.token) return a.token < b.token;
    return a.parent < b.parent;
  };
  std::vector<Cand> cands;
  auto push_children = [&](uint32_t ti, uint32_t node, int32_t parent, int32_t depth) {
    const SourceTree& t = trees[ti];
    for (uint32_t c = t.nodes[node].first_child; c != kNoNode; c = t.nodes[c].next_sibling) {
      const double w = t.nodes[c].weight;
      if (!(w > 0)) continue;
      double priority = t.scale * table.priority(t.source, t.match_len, depth, w / t.total);
      if (t.level != 1) priority *= std::pow(t.level, depth - 1);  // a request's per-source correction
      cands.push_back({priority, depth, ti, t.nodes[c].token, parent, c});
    }
  };
  for (uint32_t i = 0; i < trees.size(); ++i) {
    if (!trees[i].empty() && trees[i].max_depth >= 1) push_children(i, trees[i].root, -1, 1);
  }
  std::vector<RefNode> out;
  std::map<std::pair<int32_t, token_t>, int32_t> child_of;
  while (!cands.empty() && int(out.size()) < budget) {
    size_t best = 0;
    for (size_t k = 1; k < cands.size(); ++k) {
      if (better(cands[k], cands[best])) best = k;
    }
    const Cand c = cands[best];
    cands.erase(cands.begin() + std::ptrdiff_t(best));
    auto [it, inserted] = child_of.try_emplace({c.parent, c.token}, int32_t(out.size()));
    if (inserted) out.push_back({c.token, c.parent, c.depth, float(c.priority), uint8_t(trees[c.tree].source)});
    if (c.depth < trees[c.tree].max_depth) push_children(c.tree, c.node, it->second, c.depth + 1);
  }
  return out;
}

ContinuationTree random_tree(std::mt19937_64& rng) {
  ContinuationTree t;
  std::uniform_int_distribution<int> npaths(0, 12), len(1, 5), tok(0, 4), w(1, 9);
  for (int p = npaths(rng); p > 0; --p) {
    std::vector<token_t> path(size_t(len(rng)));
    for (auto& x : path) x = token_t(tok(rng));
    t.add_path(path, float(w(rng)));
  }
  return t;
}

// Random source trees under a random score table; `with_factors`: each tree also gets a request's
// scale and level (Drafter::draft's SourceFactors). Filled in place: the views point into `owned`.
struct RandomMerge {
  ScoreTable table;
  std::vector<ContinuationTree> owned;
  std::vector<SourceTree> views;
};

void random_merge(std::mt19937_64& rng, int min_trees, bool with_factors, RandomMerge& out) {
  const int max_match = 3, max_depth = 5;
  std::vector<double> factors(size_t(kNumSources) * (max_match + 1) * (max_depth + 1));
  std::uniform_real_distribution<double> f(0.0, 1.0);
  // Coarse factors make equal priorities (the tie-breaks) common.
  for (auto& x : factors) x = std::round(f(rng) * 4) / 4;
  out.table = ScoreTable(max_match, max_depth, factors);
  const int ntrees = std::uniform_int_distribution<int>(min_trees, 4)(rng);
  out.owned.clear();
  out.owned.resize(size_t(ntrees));
  out.views.clear();
  for (int i = 0; i < ntrees; ++i) {
    out.owned[size_t(i)] = random_tree(rng);
    SourceTree v = out.owned[size_t(i)].view(Source(i % kNumSources), i % (max_match + 1),
                                             std::uniform_int_distribution<int>(0, max_depth)(rng));
    if (with_factors) {
      v.scale = std::round(f(rng) * 8) / 4;
      v.level = 0.5 + std::round(f(rng) * 4) / 4;
    }
    out.views.push_back(v);
  }
}

TEST(TreeMerger, MatchesTheNaiveAlgorithm1) {
  std::mt19937_64 rng(2024);
  TreeMerger merger;  // reused across rounds, as a drafter thread does
  RandomMerge m;
  for (int round = 0; round < 500; ++round) {
    random_merge(rng, 0, round % 2, m);
    const ScoreTable& table = m.table;
    const std::vector<SourceTree>& views = m.views;
    const int budget = std::uniform_int_distribution<int>(0, 30)(rng);
    DraftTree out;
    merger.merge(views, table, budget, out);
    const auto want = reference_merge(views, table, budget);
    ASSERT_EQ(out.size(), want.size()) << "round " << round;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(out.tokens[i], want[i].token) << "round " << round << " node " << i;
      EXPECT_EQ(out.parents[i], want[i].parent) << "round " << round << " node " << i;
      EXPECT_EQ(out.depths[i], want[i].depth) << "round " << round << " node " << i;
      EXPECT_EQ(out.scores[i], want[i].score) << "round " << round << " node " << i;
      EXPECT_EQ(out.sources[i], want[i].source) << "round " << round << " node " << i;
    }
  }
}

// The highest priority of a tree's candidates (every node within max_depth).
double max_candidate_priority(const SourceTree& t, const ScoreTable& table) {
  double best = 0;
  std::vector<std::pair<uint32_t, int>> stack{{t.root, 0}};
  while (!stack.empty()) {
    const auto [node, depth] = stack.back();
    stack.pop_back();
    if (depth >= t.max_depth) continue;
    for (uint32_t c = t.nodes[node].first_child; c != kNoNode; c = t.nodes[c].next_sibling) {
      double p = t.scale * table.priority(t.source, t.match_len, depth + 1, t.nodes[c].weight / t.total);
      if (t.level != 1) p *= std::pow(t.level, depth);
      best = std::max(best, p);
      stack.push_back({c, depth + 1});
    }
  }
  return best;
}

// Drafter::draft merges every source but the datastore while their best candidate beats the
// datastore's bound, and adds the datastore only if the budget is not full by then.
TEST(TreeMerger, ATreeAddedOnceTheOthersFallToItsBoundMergesAsIfThereFromTheStart) {
  std::mt19937_64 rng(7);
  TreeMerger full, steps;
  int stopped = 0, filled = 0;
  RandomMerge m;
  for (int round = 0; round < 2000; ++round) {
    random_merge(rng, 1, true, m);
    const ScoreTable& table = m.table;
    const std::vector<SourceTree>& views = m.views;
    const int ntrees = int(views.size());
    const uint32_t late = uint32_t(std::uniform_int_distribution<int>(0, ntrees - 1)(rng));
    const SourceTree& t = views[late];
    // The floor: a bound as the drafter's (the table's best cell), or the tree's exact best,
    // which puts candidates of other trees exactly at the floor.
    const double level = t.level > 1 ? std::pow(t.level, t.max_depth - 1) : 1.0;
    const double floor = round % 3 ? t.scale * table.max_priority(t.source) * level
                                   : max_candidate_priority(t, table);
    ASSERT_LE(max_candidate_priority(t, table), t.scale * table.max_priority(t.source) * level);
    const int budget = std::uniform_int_distribution<int>(0, 30)(rng);

    DraftTree want, got;
    full.merge(views, table, budget, want);
    std::vector<SourceTree> later = views;
    later[late] = SourceTree{};
    steps.start(later, table, got);
    steps.run(later, table, budget, got, floor);
    (got.size() < size_t(budget) ? stopped : filled) += 1;
    later[late] = views[late];
    steps.add(later, late, table);
    steps.run(later, table, budget, got);
    ASSERT_EQ(got.tokens, want.tokens) << "round " << round;
    ASSERT_EQ(got.parents, want.parents) << "round " << round;
    ASSERT_EQ(got.depths, want.depths) << "round " << round;
    ASSERT_EQ(got.scores, want.scores) << "round " << round;
    ASSERT_EQ(got.sources, want.sources) << "round " << round;
  }
  EXPECT_GT(stopped, 100);  // both ways taken often
  EXPECT_GT(filled, 100);
}

TEST(ScoreTable, MaxPriorityBoundsEveryCellAndCurve) {
  const int max_match = 2, max_depth = 3;
  std::vector<double> factors(size_t(kNumSources) * (max_match + 1) * (max_depth + 1), 0.5);
  std::vector<int32_t> curve_of(factors.size(), -1);
  for (size_t c = 0; c < factors.size(); ++c) {
    if (c % (max_depth + 1) == 0) factors[c] = 9;  // depth 0: never read, so not in the bound
  }
  const size_t input = size_t(Source::kInput) * (max_match + 1) * (max_depth + 1);
  factors[input + 1 * (max_depth + 1) + 2] = 0.8;  // match 1, depth 2
  curve_of[input + 1 * (max_depth + 1) + 2] = 0;
  const ScoreTable table(max_match, max_depth, factors, curve_of, {Curve{{0.0, 0.5, 0.9}, {0.1, 0.6, 0.7}}});
  EXPECT_DOUBLE_EQ(table.max_priority(Source::kDatastore), 0.5);
  EXPECT_DOUBLE_EQ(table.max_priority(Source::kInput), 0.8 * 0.7);
  EXPECT_DOUBLE_EQ(table.max_priority(Source::kCopy), 0.5);  // beyond the table: its last source
  for (int m = 0; m <= max_match + 1; ++m) {
    for (int d = 1; d <= max_depth + 1; ++d) {
      for (double p = 0; p <= 1.0; p += 0.125) {
        EXPECT_LE(table.priority(Source::kInput, m, d, p), table.max_priority(Source::kInput));
      }
    }
  }
}

TEST(TreeMerger, DraftsAreWellFormed) {
  std::mt19937_64 rng(3);
  TreeMerger merger;
  const ScoreTable table;  // raw probabilities
  for (int round = 0; round < 200; ++round) {
    std::vector<ContinuationTree> owned(3);
    std::vector<SourceTree> views;
    for (auto& t : owned) {
      t = random_tree(rng);
      views.push_back(t.view(Source::kDatastore, 1, 16));
    }
    const int budget = std::uniform_int_distribution<int>(1, 64)(rng);
    DraftTree out;
    merger.merge(views, table, budget, out);
    ASSERT_LE(out.size(), size_t(budget));
    std::map<std::pair<int32_t, token_t>, int> seen;
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_GE(out.parents[i], -1);
      ASSERT_LT(out.parents[i], int32_t(i)) << "a parent must precede its child";
      ASSERT_EQ(out.depths[i], out.parents[i] < 0 ? 1 : out.depths[size_t(out.parents[i])] + 1);
      const int copies = ++seen[std::make_pair(out.parents[i], out.tokens[i])];
      ASSERT_EQ(copies, 1) << "identical siblings must merge";
    }
  }
}

TEST(TreeMerger, BudgetZeroAndNoTrees) {
  TreeMerger merger;
  DraftTree out;
  ContinuationTree t;
  const std::vector<token_t> path{1, 2};
  t.add_path(path);
  const std::vector<SourceTree> views{t.view(Source::kInput, 1, 4)};
  merger.merge(views, ScoreTable(), 0, out);
  EXPECT_EQ(out.size(), 0u);
  merger.merge({}, ScoreTable(), 10, out);
  EXPECT_EQ(out.size(), 0u);
  merger.merge(views, ScoreTable(), 10, out);
  EXPECT_EQ(out.size(), 2u);
}

}  // namespace
}  // namespace sssd
