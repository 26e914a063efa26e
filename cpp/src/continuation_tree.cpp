#include "sssd/continuation_tree.h"

#include <algorithm>

namespace sssd {

void ContinuationTree::clear() {
  nodes_.clear();
  spans_.clear();
  staged_tokens_ = 0;
  staged_.clear();
  run_ends_.clear();
  order_.clear();
  end_token_ = -1;
  nodes_.push_back({0, 0.0f, kNoNode, kNoNode});
}

uint32_t ContinuationTree::add_node(uint32_t parent, token_t token, float weight) {
  // Prepend: child order carries no meaning (the merger orders by weight, then token).
  const uint32_t id = uint32_t(nodes_.size());
  nodes_.push_back({token, weight, kNoNode, nodes_[parent].first_child});
  nodes_[parent].first_child = id;
  return id;
}

uint32_t ContinuationTree::child(uint32_t parent, token_t token) {
  for (uint32_t c = nodes_[parent].first_child; c != kNoNode; c = nodes_[c].next_sibling) {
    if (nodes_[c].token == token) return c;
  }
  return add_node(parent, token, 0.0f);
}

void ContinuationTree::add_path(std::span<const token_t> tokens, float weight) {
  nodes_[0].weight += weight;
  uint32_t node = 0;
  for (token_t t : tokens) {
    node = child(node, t);
    nodes_[node].weight += weight;
  }
}

void ContinuationTree::stage(std::span<const token_t> tokens, End end, float weight) {
  staged_.push_back({tokens.data(), uint16_t(tokens.size()), end, weight});
  staged_tokens_ += tokens.size();
}

void ContinuationTree::end_run() {
  if (run_ends_.empty() ? !staged_.empty() : run_ends_.back() != staged_.size()) {
    run_ends_.push_back(uint32_t(staged_.size()));
  }
}

void ContinuationTree::commit_runs(int64_t end_token) {
  end_run();
  end_token_ = end_token;
  // Suffix order of two staged paths: by tokens; when one is a prefix of
  // the other, a separator-ended path sorts after, a stream-ended one before.
  auto less = [&](const Staged& a, const Staged& b) {
    const token_t* x = a.tokens;
    const token_t* y = b.tokens;
    const size_t n = std::min(a.len, b.len);
    for (size_t i = 0; i < n; ++i) {
      if (x[i] != y[i]) return x[i] < y[i];
    }
    if (a.len == b.len) return false;
    return a.len < b.len ? a.end != End::kSeparator : b.end == End::kSeparator;
  };
  // k-way merge of the runs (a handful: the base level and the levels above).
  order_.clear();
  order_.reserve(staged_.size());
  head_.resize(run_ends_.size());
  auto& head = head_;
  for (size_t r = 0; r < run_ends_.size(); ++r) head[r] = r == 0 ? 0 : run_ends_[r - 1];
  float total = 0;
  while (true) {
    int best = -1;
    for (size_t r = 0; r < run_ends_.size(); ++r) {
      if (head[r] < run_ends_[r] && (best < 0 || less(staged_[head[r]], staged_[head[size_t(best)]]))) {
        best = int(r);
      }
    }
    if (best < 0) break;
    total += staged_[head[size_t(best)]].weight;
    order_.push_back(head[size_t(best)]++);
  }
  nodes_[0].weight += total;
  // Every node is a distinct path prefix, or an end-token child of one: the
  // capacity never has to grow, so views of nodes_ stay valid while expanding.
  nodes_.reserve(2 * staged_tokens_ + 2);
  spans_.reserve(nodes_.capacity());
  spans_.assign(1, {0, uint32_t(order_.size()), 0, true});
}

void ContinuationTree::expand(uint32_t node) {
  if (node >= spans_.size() || !spans_[node].open) return;
  Span& span = spans_[node];
  span.open = false;
  const uint32_t a = span.a, b = span.b, d = span.depth;
  float end_weight = 0;
  auto ended = [&](const Staged& p) {  // the path ends at or above this node
    if (p.len != d || p.end != End::kSeparator || end_token_ < 0) return p.len <= d;
    end_weight += p.weight;
    return true;
  };
  for (uint32_t k = a; k < b;) {
    const Staged& p = staged_[order_[k]];
    if (ended(p)) {
      ++k;
      continue;
    }
    // Sorted: the paths continuing with this token are contiguous, except
    // for paths ending here, which sort where their text does (continuations
    // cut at different lengths) and may sit among them.
    const token_t t = p.tokens[d];
    float w = 0;
    uint32_t k1 = k;
    while (k1 < b) {
      const Staged& q = staged_[order_[k1]];
      if (ended(q)) {
        ++k1;
        continue;
      }
      if (q.tokens[d] != t) break;
      w += q.weight;
      ++k1;
    }
    add_node(node, t, w);
    spans_.push_back({k, k1, d + 1, true});
    k = k1;
  }
  if (end_weight > 0) {
    // The end token may also continue as an ordinary token here: same node.
    uint32_t c = nodes_[node].first_child;
    while (c != kNoNode && nodes_[c].token != token_t(end_token_)) c = nodes_[c].next_sibling;
    if (c == kNoNode) {
      add_node(node, token_t(end_token_), end_weight);
      spans_.push_back({b, b, d + 1, false});
    } else {
      nodes_[c].weight += end_weight;
    }
  }
}

void ContinuationTree::expand_all() {
  for (uint32_t i = 0; i < nodes_.size(); ++i) expand(i);
}

SourceTree ContinuationTree::view(Source source, int match_len, int max_depth) {
  SourceTree v;
  v.nodes = nodes_.data();
  v.root = 0;
  v.total = nodes_[0].weight;
  v.max_depth = max_depth;
  v.source = source;
  v.match_len = match_len;
  v.expander = spans_.empty() ? nullptr : this;
  return v;
}

}  // namespace sssd
