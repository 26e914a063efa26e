#include "sssd/request_trie.h"

#include <algorithm>

#include "sssd/check.h"

namespace sssd {

RequestTrie::RequestTrie(int max_depth, size_t max_nodes, CopySettings copy)
    : max_depth_(max_depth), max_nodes_(max_nodes), copy_(copy.max_tokens, copy.min_match, copy.half_life) {
  SSSD_CHECK_ARG(max_depth >= 2 && max_depth <= 1024, "trie depth must be in [2, 1024], got ",
                 max_depth);
  nodes_.push_back({0, 0.0f, kNoNode, kNoNode});
}

uint32_t RequestTrie::child(uint32_t parent, token_t token) {
  // A node with one child needs no index: most of the trie's nodes are on
  // n-grams seen once, chains of only children. The index holds the children
  // of nodes with two or more.
  const uint32_t first = nodes_[parent].first_child;
  const bool branching = first != kNoNode && nodes_[first].next_sibling != kNoNode;
  if (first != kNoNode && !branching && nodes_[first].token == token) return first;
  if (branching) {
    const uint32_t found = index_.find(parent, token);
    if (found != kNoNode) return found;
  }
  if (nodes_.size() >= max_nodes_) return kNoNode;
  const uint32_t c = uint32_t(nodes_.size());
  // Prepend to the sibling list: O(1); child order does not affect drafts
  // (the merger orders candidates by score, then token id).
  nodes_.push_back({token, 0.0f, kNoNode, first});
  nodes_[parent].first_child = c;
  if (first != kNoNode && !branching) index_.insert(parent, nodes_[first].token, first);  // now two
  if (first != kNoNode) index_.insert(parent, token, c);
  return c;
}

void RequestTrie::extend(std::span<const token_t> tokens) {
  for (const token_t t : tokens) {
    SSSD_CHECK_ARG(t != kSeparator, "token id ", t, " is reserved as the document separator");
    // The n-grams ending at the new token extend those ending one earlier.
    const size_t depth = std::min(tail_.size() + 1, size_t(max_depth_));
    tail_.resize(depth, kNoNode);
    for (size_t k = depth; k-- > 1;) {
      const uint32_t prev = tail_[k - 1];
      tail_[k] = prev == kNoNode ? kNoNode : child(prev, t);
    }
    tail_[0] = child(0, t);
    for (const uint32_t node : tail_) {
      if (node != kNoNode) nodes_[node].weight += 1.0f;
    }
    copy_.append(tokens_, t);
    tokens_.push_back(t);
  }
}

SourceTree RequestTrie::continuations(int len) const {
  SourceTree v;
  v.nodes = nodes_.data();
  v.source = Source::kInput;
  v.match_len = len;
  if (len < 1 || len >= max_depth_ || size_t(len) > tail_.size()) return v;
  const uint32_t node = tail_[size_t(len) - 1];
  if (node == kNoNode) return v;
  v.root = node;
  v.total = double(nodes_[node].weight) - 1.0;  // the occurrence at the end has no next token
  v.max_depth = max_depth_ - len;
  return v;
}

size_t RequestTrie::memory_bytes() const {
  return tokens_.capacity() * sizeof(token_t) + nodes_.capacity() * sizeof(TreeNode) +
         index_.memory_bytes() + tail_.capacity() * sizeof(uint32_t) + copy_.memory_bytes();
}

std::string RequestTrie::check_integrity() const {
  // Depth-first walk from the root, checking counts, index and depth.
  std::vector<std::pair<uint32_t, int>> stack{{0, 0}};
  size_t seen = 0, indexed = 0;
  while (!stack.empty()) {
    const auto [node, depth] = stack.back();
    stack.pop_back();
    ++seen;
    if (depth > max_depth_) return detail::concat("node ", node, " is deeper than ", max_depth_);
    double sum = 0;
    const uint32_t first = nodes_[node].first_child;
    if (first != kNoNode && first >= nodes_.size()) {
      return detail::concat("node ", node, " has child ", first, " out of range");
    }
    // Only the children of a node with two or more are indexed (see child()).
    const bool branching = first != kNoNode && nodes_[first].next_sibling != kNoNode;
    for (uint32_t c = first; c != kNoNode; c = nodes_[c].next_sibling) {
      if (c >= nodes_.size()) return detail::concat("node ", node, " has child ", c, " out of range");
      indexed += branching;
      if (index_.find(node, nodes_[c].token) != (branching ? c : kNoNode)) {
        return detail::concat("child index disagrees at node ", node, " token ", nodes_[c].token);
      }
      sum += nodes_[c].weight;
      stack.push_back({c, depth + 1});
    }
    if (node != 0 && sum > nodes_[node].weight) {
      return detail::concat("children of node ", node, " count ", sum, " > its ", nodes_[node].weight);
    }
  }
  if (seen != nodes_.size()) return detail::concat(nodes_.size() - seen, " nodes are unreachable");
  if (index_.size() != indexed) return "child index size does not match the branching nodes' children";
  if (copy_.enabled() && !copy_.automaton().capped() && copy_.automaton().size() != tokens_.size()) {
    return "the copy index does not hold the whole text";
  }
  return copy_.automaton().check_integrity();
}

}  // namespace sssd
