// ContinuationTree's lazy expansion.
//
// commit_runs() reserves the node array once (2 * staged tokens + 2) and
// views handed to the merger point into it, so expanding must never
// reallocate it: the reserved-capacity invariant. It must hold for sorted
// runs (what a valid datastore stages) and for unsorted ones (what a corrupt
// suffix array stages). For sorted runs the lazy tree must equal the eager
// tree of the same paths (add_path), with end-token children where a path
// ended at a separator.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "sssd/continuation_tree.h"

namespace sssd {
namespace {

using End = ContinuationTree::End;
using Paths = std::map<std::vector<token_t>, double>;

struct Staged {
  std::vector<token_t> tokens;
  End end;
  float weight;
};

// Suffix order of staged paths (as the datastore hands them over).
bool staged_less(const Staged& a, const Staged& b) {
  const size_t n = std::min(a.tokens.size(), b.tokens.size());
  for (size_t i = 0; i < n; ++i) {
    if (a.tokens[i] != b.tokens[i]) return a.tokens[i] < b.tokens[i];
  }
  if (a.tokens.size() == b.tokens.size()) return false;
  return a.tokens.size() < b.tokens.size() ? a.end != End::kSeparator : b.end == End::kSeparator;
}

std::vector<std::vector<Staged>> random_runs(std::mt19937_64& rng, bool sorted) {
  std::uniform_int_distribution<int> nruns(1, 4), nrun(0, 30), len(0, 6), tok(0, 3), endk(0, 2), w(1, 3);
  std::vector<std::vector<Staged>> runs(size_t(nruns(rng)));
  for (auto& run : runs) {
    run.resize(size_t(nrun(rng)));
    for (auto& s : run) {
      s.tokens.resize(size_t(len(rng)));
      for (auto& t : s.tokens) t = token_t(tok(rng));
      s.end = End(endk(rng));
      s.weight = float(w(rng));
    }
    if (sorted) std::stable_sort(run.begin(), run.end(), staged_less);
  }
  return runs;
}

void stage_all(ContinuationTree& tree, const std::vector<std::vector<Staged>>& runs) {
  for (const auto& run : runs) {
    for (const auto& s : run) tree.stage(s.tokens, s.end, s.weight);
    tree.end_run();
  }
}

Paths paths_of(const ContinuationTree& tree) {
  Paths out;
  const auto& nodes = tree.nodes();
  std::vector<std::pair<uint32_t, std::vector<token_t>>> stack{{0, {}}};
  while (!stack.empty()) {
    auto [node, path] = stack.back();
    stack.pop_back();
    if (node != 0) out[path] += nodes[node].weight;
    for (uint32_t c = nodes[node].first_child; c != kNoNode; c = nodes[c].next_sibling) {
      auto p = path;
      p.push_back(nodes[c].token);
      stack.push_back({c, p});
    }
  }
  return out;
}

TEST(ContinuationTree, ExpansionNeverReallocatesTheReservedNodes) {
  std::mt19937_64 rng(99);
  for (int round = 0; round < 400; ++round) {
    const bool sorted = round % 2 == 0;
    const auto runs = random_runs(rng, sorted);
    ContinuationTree tree;
    stage_all(tree, runs);
    tree.commit_runs(/*end_token=*/round % 3 == 0 ? -1 : 2);
    const TreeNode* data = tree.nodes().data();
    const size_t capacity = tree.nodes().capacity();
    size_t staged_tokens = 0, staged = 0;
    for (const auto& run : runs) {
      for (const auto& s : run) staged_tokens += s.tokens.size(), ++staged;
    }
    EXPECT_EQ(capacity, 2 * staged_tokens + 2);
    // Expand through a view, as the merger does, in a random order of nodes.
    const SourceTree view = tree.view(Source::kDatastore, 1, 8);
    ASSERT_EQ(view.nodes, data);
    std::vector<uint32_t> open{0};
    while (!open.empty()) {
      const size_t pick = std::uniform_int_distribution<size_t>(0, open.size() - 1)(rng);
      const uint32_t node = open[pick];
      open.erase(open.begin() + std::ptrdiff_t(pick));
      view.expander->expand(node);
      ASSERT_EQ(tree.nodes().data(), data) << "expansion reallocated the node array";
      for (uint32_t c = tree.nodes()[node].first_child; c != kNoNode; c = tree.nodes()[c].next_sibling) {
        open.push_back(c);
      }
    }
    EXPECT_EQ(tree.nodes().capacity(), capacity);
    EXPECT_LE(tree.nodes().size(), capacity);
    // Weights: the root holds every staged path, a node at least its children.
    float total = 0;
    for (const auto& run : runs) {
      for (const auto& s : run) total += s.weight;
    }
    EXPECT_EQ(tree.root_weight(), total);
    for (const TreeNode& n : tree.nodes()) {
      float children = 0;
      for (uint32_t c = n.first_child; c != kNoNode; c = tree.nodes()[c].next_sibling) {
        children += tree.nodes()[c].weight;
      }
      EXPECT_LE(children, n.weight + 1e-3f);
    }
  }
}

TEST(ContinuationTree, LazyTreeOfSortedRunsEqualsTheEagerTree) {
  std::mt19937_64 rng(5);
  for (int round = 0; round < 300; ++round) {
    const auto runs = random_runs(rng, /*sorted=*/true);
    const int64_t end_token = round % 2 ? 7 : -1;
    ContinuationTree lazy;
    stage_all(lazy, runs);
    lazy.commit_runs(end_token);
    lazy.expand_all();
    ContinuationTree eager;
    for (const auto& run : runs) {
      for (const auto& s : run) {
        auto path = s.tokens;
        if (s.end == End::kSeparator && end_token >= 0) path.push_back(token_t(end_token));
        eager.add_path(path, s.weight);
      }
    }
    EXPECT_EQ(lazy.root_weight(), eager.root_weight());
    EXPECT_EQ(paths_of(lazy), paths_of(eager)) << "round " << round;
  }
}

TEST(ContinuationTree, ClearKeepsNoStaleSpans) {
  ContinuationTree tree;
  const std::vector<token_t> a{1, 2, 3}, b{1, 4};
  tree.stage(a, End::kLength);
  tree.stage(b, End::kStream);
  tree.commit_runs(-1);
  tree.expand_all();
  EXPECT_EQ(tree.nodes().size(), 5u);  // root, 1, 2, 3, 4
  tree.clear();
  EXPECT_EQ(tree.nodes().size(), 1u);
  EXPECT_EQ(tree.root_weight(), 0.0f);
  tree.expand(0);  // an eager (empty) tree: no-op
  EXPECT_EQ(tree.nodes().size(), 1u);
}

}  // namespace
}  // namespace sssd
