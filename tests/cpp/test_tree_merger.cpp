// TreeMerger against a naive Algorithm 1.
//
// The reference keeps every candidate in one list and takes the best by the
// merger's full order (priority, then shallower, then lower tree index,
// token and parent): the merger's pop order must be the same although it
// queues each sorted sibling list one entry at a time. Source trees are
// random eager trees with random weights; discounts are random.
#include <gtest/gtest.h>

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

TEST(TreeMerger, MatchesTheNaiveAlgorithm1) {
  std::mt19937_64 rng(2024);
  TreeMerger merger;  // reused across rounds, as a drafter thread does
  for (int round = 0; round < 500; ++round) {
    const int max_match = 3, max_depth = 5;
    std::vector<double> factors(size_t(kNumSources) * (max_match + 1) * (max_depth + 1));
    std::uniform_real_distribution<double> f(0.0, 1.0);
    // Coarse factors make equal priorities (the tie-breaks) common.
    for (auto& x : factors) x = std::round(f(rng) * 4) / 4;
    const ScoreTable table(max_match, max_depth, factors);
    const int ntrees = std::uniform_int_distribution<int>(0, 4)(rng);
    std::vector<ContinuationTree> owned(static_cast<size_t>(ntrees));
    std::vector<SourceTree> views;
    for (int i = 0; i < ntrees; ++i) {
      owned[size_t(i)] = random_tree(rng);
      SourceTree v = owned[size_t(i)].view(Source(i % kNumSources), i % (max_match + 1),
                                           std::uniform_int_distribution<int>(0, max_depth)(rng));
      if (round % 2) {  // per-request source factors (Drafter::draft's SourceFactors)
        v.scale = std::round(f(rng) * 8) / 4;
        v.level = 0.5 + std::round(f(rng) * 4) / 4;
      }
      views.push_back(v);
    }
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
