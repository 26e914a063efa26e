// The weighted continuation trees that drafting sources produce and the
// merger consumes.
//
// Every source (the datastore, the request's input trie, a caller-supplied
// model draft) hands the merger a SourceTree: a non-owning view of a node
// array in first-child / next-sibling form. A node's weight over the tree's
// total is the source's probability for the path from the root to that node
// (count(path) / count(prefix) for retrieval sources).
#pragma once

#include <cstdint>
#include <limits>

#include "sssd/types.h"

namespace sssd {

inline constexpr uint32_t kNoNode = std::numeric_limits<uint32_t>::max();

class ContinuationTree;

/// One node of a continuation tree (16 bytes).
struct TreeNode {
  token_t token;          ///< token on the edge from the parent
  float weight;           ///< occurrences of the path (or path probability); >= children's sum
  uint32_t first_child;   ///< index of the first child, kNoNode if a leaf
  uint32_t next_sibling;  ///< index of the next child of the same parent, kNoNode if last
};

/// A continuation tree to merge, viewed in place (the owner must outlive it).
struct SourceTree {
  const TreeNode* nodes = nullptr;  ///< node array
  uint32_t root = kNoNode;          ///< the node standing for the matched prefix
  double total = 0;                 ///< probability of node = weight / total; > 0
  int max_depth = 0;                ///< nodes deeper than this below root are ignored
  Source source = Source::kDatastore;
  int match_len = 0;                ///< tokens of context matched (0 for external trees)
  const float* draft_probs = nullptr;  ///< optional q(token | parent path), indexed like nodes
  ContinuationTree* expander = nullptr;  ///< lazy tree: expand(node) before reading its children
  /// If > 0: a node's priority is its probability times depth_rate^depth (the copy source's
  /// per-request rate of continuing one more token: an acceptance probability, calibrated by
  /// the request's own evidence) instead of the table's.
  double depth_rate = 0;
  /// Every priority of the tree is multiplied by this (where a confident copy makes the other
  /// sources' different guesses less likely: by the probability that the copy is wrong).
  double scale = 1;
  /// Every priority of the tree is multiplied by level^(depth - 1): a request's measured
  /// correction of how fast its source's candidates lose their odds along a path (1: none).
  double level = 1;

  /// No continuations. (A lazy tree's root may look childless before it is
  /// expanded; its total decides.)
  bool empty() const {
    return root == kNoNode || total <= 0 || (!expander && nodes[root].first_child == kNoNode);
  }
};

}  // namespace sssd
