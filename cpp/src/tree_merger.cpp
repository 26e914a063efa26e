#include "sssd/tree_merger.h"

#include "sssd/check.h"
#include "sssd/continuation_tree.h"
#include "sssd/parent_tree.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace sssd {

void TreeMerger::push(uint32_t sibling, uint32_t end, uint32_t tree, int32_t parent, int32_t depth) {
  const Sibling& s = siblings_[sibling];
  heap_.push_back({s.priority, sibling, end, tree, parent, depth, s.token});
  std::push_heap(heap_.begin(), heap_.end(), Worse{});
}

void TreeMerger::expand(const SourceTree& t, uint32_t tree_index, uint32_t node, int32_t draft_parent,
                        int32_t depth, const ScoreTable& table) {
  if (t.expander) t.expander->expand(node);
  const uint32_t begin = uint32_t(siblings_.size());
  for (uint32_t c = t.nodes[node].first_child; c != kNoNode; c = t.nodes[c].next_sibling) {
    const double weight = t.nodes[c].weight;
    if (!(weight > 0)) continue;
    const double prob = weight / t.total;
    double priority = t.scale * (t.depth_rate > 0 ? prob * std::pow(t.depth_rate, depth)
                                                  : table.priority(t.source, t.match_len, depth, prob));
    if (t.level != 1) priority *= std::pow(t.level, depth - 1);
    siblings_.push_back({priority, prob, c, t.nodes[c].token});
  }
  const uint32_t end = uint32_t(siblings_.size());
  if (begin == end) return;
  // Best first; equal priorities by token, as the queue would order them.
  std::sort(siblings_.begin() + begin, siblings_.end(), [](const Sibling& a, const Sibling& b) {
    return a.priority != b.priority ? a.priority > b.priority : a.token < b.token;
  });
  push(begin, end, tree_index, draft_parent, depth);
}

void TreeMerger::start(std::span<const SourceTree> trees, const ScoreTable& table, DraftTree& out) {
  out.clear();
  heap_.clear();
  siblings_.clear();
  first_child_.clear();
  next_sibling_.clear();
  root_first_child_ = -1;
  for (uint32_t i = 0; i < trees.size(); ++i) add(trees, i, table);
}

void TreeMerger::add(std::span<const SourceTree> trees, uint32_t index, const ScoreTable& table) {
  const SourceTree& t = trees[index];
  if (!t.empty() && t.max_depth >= 1) expand(t, index, t.root, -1, 1, table);
}

void TreeMerger::run(std::span<const SourceTree> trees, const ScoreTable& table, int budget, DraftTree& out,
                     double floor) {
  while (!heap_.empty() && out.size() < size_t(std::max(budget, 0))) {
    if (!(heap_.front().priority > floor)) return;
    std::pop_heap(heap_.begin(), heap_.end(), Worse{});
    const Candidate c = heap_.back();
    heap_.pop_back();
    // Its next sibling (same parent, same discount) becomes a candidate.
    if (c.sibling + 1 < c.end) push(c.sibling + 1, c.end, c.tree, c.parent, c.depth);
    const SourceTree& t = trees[c.tree];
    const uint32_t source_node = siblings_[c.sibling].node;

    // Insert under c.parent, or merge with the sibling holding the same token.
    const int32_t head = c.parent < 0 ? root_first_child_ : first_child_[size_t(c.parent)];
    int32_t id = head;
    while (id >= 0 && out.tokens[size_t(id)] != c.token) id = next_sibling_[size_t(id)];
    const float q = t.draft_probs ? t.draft_probs[source_node] : std::numeric_limits<float>::quiet_NaN();
    if (id < 0) {
      id = int32_t(out.size());
      out.tokens.push_back(c.token);
      out.parents.push_back(c.parent);
      out.depths.push_back(c.depth);
      out.scores.push_back(float(c.priority));
      out.probs.push_back(float(siblings_[c.sibling].prob));
      out.match_lens.push_back(uint8_t(std::min(t.match_len, 255)));
      out.sources.push_back(uint8_t(t.source));
      out.draft_probs.push_back(q);
      first_child_.push_back(-1);
      next_sibling_.push_back(head);
      (c.parent < 0 ? root_first_child_ : first_child_[size_t(c.parent)]) = id;
    } else if (std::isnan(out.draft_probs[size_t(id)])) {
      out.draft_probs[size_t(id)] = q;
    }
    if (c.depth < t.max_depth) expand(t, c.tree, source_node, id, c.depth + 1, table);
  }
}

DraftBatch concat(const std::vector<DraftTree>& trees) {
  DraftBatch batch;
  batch.offsets.reserve(trees.size() + 1);
  batch.offsets.push_back(0);
  size_t total = 0;
  for (const auto& t : trees) total += t.size();
  DraftTree& n = batch.nodes;
  n.tokens.reserve(total);
  n.parents.reserve(total);
  n.depths.reserve(total);
  n.scores.reserve(total);
  n.probs.reserve(total);
  n.match_lens.reserve(total);
  n.sources.reserve(total);
  n.draft_probs.reserve(total);
  for (const auto& t : trees) {
    n.tokens.insert(n.tokens.end(), t.tokens.begin(), t.tokens.end());
    n.parents.insert(n.parents.end(), t.parents.begin(), t.parents.end());
    n.depths.insert(n.depths.end(), t.depths.begin(), t.depths.end());
    n.scores.insert(n.scores.end(), t.scores.begin(), t.scores.end());
    n.probs.insert(n.probs.end(), t.probs.begin(), t.probs.end());
    n.match_lens.insert(n.match_lens.end(), t.match_lens.begin(), t.match_lens.end());
    n.sources.insert(n.sources.end(), t.sources.begin(), t.sources.end());
    n.draft_probs.insert(n.draft_probs.end(), t.draft_probs.begin(), t.draft_probs.end());
    batch.offsets.push_back(int64_t(n.tokens.size()));
  }
  return batch;
}

std::vector<int32_t> best_chain(const int32_t* parents, const float* scores, size_t n) {
  // Parents precede children, so one backward pass computes, for every node,
  // the best sum of scores over chains that start at it.
  std::vector<double> best(n, 0.0);
  std::vector<int32_t> next(n, -1);
  double root_best = 0;
  int32_t root_next = -1;
  for (size_t i = n; i-- > 0;) {
    best[i] += scores[i];
    const int32_t p = parents[i];
    double& pb = p < 0 ? root_best : best[size_t(p)];
    int32_t& pn = p < 0 ? root_next : next[size_t(p)];
    // >= walks backwards, so ties end on the earliest-inserted child.
    if (pn < 0 || best[i] >= pb) {
      pb = best[i];
      pn = int32_t(i);
    }
  }
  std::vector<int32_t> chain;
  for (int32_t i = root_next; i >= 0; i = next[size_t(i)]) chain.push_back(i);
  return chain;
}

std::pair<std::vector<int64_t>, std::vector<int32_t>> best_chains(std::span<const int64_t> offsets,
                                                                  std::span<const int32_t> parents,
                                                                  std::span<const float> scores) {
  SSSD_CHECK_ARG(!offsets.empty() && offsets.front() == 0 && scores.size() == parents.size() &&
                     uint64_t(offsets.back()) == parents.size(),
                 "offsets must start at 0 and end at len(parents) == len(scores)");
  for (size_t b = 0; b + 1 < offsets.size(); ++b) {
    SSSD_CHECK_ARG(offsets[b] <= offsets[b + 1], "offsets must be non-decreasing (offsets[", b, "] = ", offsets[b],
                   " > offsets[", b + 1, "] = ", offsets[b + 1], ")");
  }
  // Every offset is now in [0, parents.size()].
  for (size_t b = 0; b + 1 < offsets.size(); ++b) {
    check_parents(parents.subspan(size_t(offsets[b]), size_t(offsets[b + 1] - offsets[b])),
                  detail::concat("best_chains: tree ", b));
  }
  std::pair<std::vector<int64_t>, std::vector<int32_t>> out;
  auto& [out_offsets, nodes] = out;
  out_offsets.reserve(offsets.size());
  out_offsets.push_back(0);
  for (size_t b = 0; b + 1 < offsets.size(); ++b) {
    const size_t begin = size_t(offsets[b]);
    const auto chain = best_chain(parents.data() + begin, scores.data() + begin, size_t(offsets[b + 1]) - begin);
    nodes.insert(nodes.end(), chain.begin(), chain.end());
    out_offsets.push_back(int64_t(nodes.size()));
  }
  return out;
}

}  // namespace sssd
