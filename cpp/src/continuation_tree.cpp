#include "sssd/continuation_tree.h"

#include <algorithm>

namespace sssd {

void ContinuationTree::clear() {
  nodes_.clear();
  stack_.clear();
  staged_tokens_.clear();
  staged_.clear();
  run_ends_.clear();
  run_weights_.clear();
  nodes_.push_back({0, 0.0f, kNoNode, kNoNode});
}

uint32_t ContinuationTree::child(uint32_t parent, token_t token) {
  uint32_t last = kNoNode;
  for (uint32_t c = nodes_[parent].first_child; c != kNoNode; c = nodes_[c].next_sibling) {
    if (nodes_[c].token == token) return c;
    last = c;
  }
  const uint32_t id = uint32_t(nodes_.size());
  nodes_.push_back({token, 0.0f, kNoNode, kNoNode});
  // Append (not prepend) so children keep first-seen order: deterministic output.
  if (last == kNoNode) {
    nodes_[parent].first_child = id;
  } else {
    nodes_[last].next_sibling = id;
  }
  return id;
}

void ContinuationTree::add_path(std::span<const token_t> tokens, float weight) {
  nodes_[0].weight += weight;
  uint32_t node = 0;
  for (token_t t : tokens) {
    node = child(node, t);
    nodes_[node].weight += weight;
  }
}

void ContinuationTree::add_sorted_path(std::span<const token_t> tokens,
                                       std::span<const token_t> prev, int64_t end_token,
                                       float weight) {
  nodes_[0].weight += weight;
  size_t common = 0;
  while (common < tokens.size() && common < prev.size() && tokens[common] == prev[common]) ++common;
  stack_.resize(std::min(common, stack_.size()));
  for (size_t d = 0; d < stack_.size(); ++d) nodes_[stack_[d]].weight += weight;
  for (size_t d = stack_.size(); d < tokens.size(); ++d) {
    // Sorted input: this token is new under `parent`; prepend it (child order
    // carries no meaning: the merger breaks ties by token id).
    const uint32_t parent = d == 0 ? 0 : stack_[d - 1];
    const uint32_t id = uint32_t(nodes_.size());
    nodes_.push_back({tokens[d], weight, kNoNode, nodes_[parent].first_child});
    nodes_[parent].first_child = id;
    stack_.push_back(id);
  }
  if (end_token >= 0) {
    const uint32_t end = child(stack_.empty() ? 0 : stack_.back(), token_t(end_token));
    nodes_[end].weight += weight;
  }
}

void ContinuationTree::stage(std::span<const token_t> tokens, End end) {
  staged_.push_back({uint32_t(staged_tokens_.size()), uint16_t(tokens.size()), end});
  staged_tokens_.insert(staged_tokens_.end(), tokens.begin(), tokens.end());
}

void ContinuationTree::end_run(float weight) {
  if (run_ends_.empty() ? !staged_.empty() : run_ends_.back() != staged_.size()) {
    run_ends_.push_back(uint32_t(staged_.size()));
    run_weights_.push_back(weight);
  }
}

void ContinuationTree::commit_runs(int64_t end_token) {
  end_run(1.0f);
  // Suffix order of two staged paths: by tokens; when one is a prefix of
  // the other, a separator-ended path sorts after, a stream-ended one before.
  auto less = [&](const Staged& a, const Staged& b) {
    const token_t* x = &staged_tokens_[a.offset];
    const token_t* y = &staged_tokens_[b.offset];
    const size_t n = std::min(a.len, b.len);
    for (size_t i = 0; i < n; ++i) {
      if (x[i] != y[i]) return x[i] < y[i];
    }
    if (a.len == b.len) return false;
    return a.len < b.len ? a.end != End::kSeparator : b.end == End::kSeparator;
  };
  std::span<const token_t> prev;
  stack_.clear();
  std::vector<uint32_t> head(run_ends_.size());
  for (size_t r = 0; r < run_ends_.size(); ++r) head[r] = r == 0 ? 0 : run_ends_[r - 1];
  while (true) {
    int best = -1;
    for (size_t r = 0; r < run_ends_.size(); ++r) {
      if (head[r] < run_ends_[r] && (best < 0 || less(staged_[head[r]], staged_[head[size_t(best)]]))) {
        best = int(r);
      }
    }
    if (best < 0) break;
    const Staged& p = staged_[head[size_t(best)]++];
    const float w = run_weights_[size_t(best)];
    const bool with_end = p.end == End::kSeparator && end_token >= 0;
    if (p.len == 0 && !with_end) {
      add_empty(w);
    } else {
      add_sorted_path({&staged_tokens_[p.offset], p.len}, prev, with_end ? end_token : -1, w);
      prev = {&staged_tokens_[p.offset], p.len};
    }
  }
  staged_tokens_.clear();
  staged_.clear();
  run_ends_.clear();
  run_weights_.clear();
}

SourceTree ContinuationTree::view(Source source, int match_len, int max_depth) const {
  SourceTree v;
  v.nodes = nodes_.data();
  v.root = 0;
  v.total = nodes_[0].weight;
  v.max_depth = max_depth;
  v.source = source;
  v.match_len = match_len;
  return v;
}

}  // namespace sssd
