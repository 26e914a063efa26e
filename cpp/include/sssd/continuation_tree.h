// ContinuationTree: an owned, growable weighted tree built by inserting
// token paths (the datastore's sampled continuations, an external draft).
// Paths sharing a prefix share nodes, whose weights add up.
#pragma once

#include <span>
#include <vector>

#include "sssd/tree_node.h"

namespace sssd {

class ContinuationTree {
 public:
  ContinuationTree() { clear(); }

  /// Empties the tree, keeping its capacity; the root has weight 0.
  void clear();

  /// Adds `weight` along the path `tokens` from the root, creating nodes as
  /// needed (the root's weight grows too). Children are found by a linear scan
  /// of the sibling list: continuation trees hold at most a few hundred nodes.
  void add_path(std::span<const token_t> tokens, float weight = 1.0f);

  /// How a staged continuation ended (it decides where it sorts among the
  /// paths it is a prefix of: a stream end sorts first, a separator last).
  enum class End : uint8_t { kStream = 0, kLength = 1, kSeparator = 2 };

  /// Stages one continuation of the current sorted run. A run is a sequence
  /// of continuations in suffix-array order (one backoff level's samples).
  void stage(std::span<const token_t> tokens, End end);
  /// Closes the current run; each of its paths will add `weight`.
  void end_run(float weight = 1.0f);
  /// Merges every staged run in suffix order and inserts the paths, each
  /// sharing the previous path's nodes (no child lookups): separator-ended
  /// paths get `end_token` appended if >= 0, empty ones add to the root's
  /// weight only. Summing the runs' counts this way is the backoff merge.
  void commit_runs(int64_t end_token);

  /// Adds weight to the root only: an observation with no continuation.
  void add_empty(float weight = 1.0f) { nodes_[0].weight += weight; }

  /// Child of `parent` with `token`, created with weight 0 if absent.
  uint32_t child(uint32_t parent, token_t token);

  const std::vector<TreeNode>& nodes() const { return nodes_; }
  std::vector<TreeNode>& nodes() { return nodes_; }
  float root_weight() const { return nodes_[0].weight; }

  /// View for the merger: probability of a node = weight / root weight.
  SourceTree view(Source source, int match_len, int max_depth) const;

 private:
  std::vector<TreeNode> nodes_;  // nodes_[0] is the root (its token is unused)
  // Adds a staged path after `prev` (the previous one in suffix order).
  void add_sorted_path(std::span<const token_t> tokens, std::span<const token_t> prev,
                       int64_t end_token, float weight);

  std::vector<uint32_t> stack_;  // nodes of the previous sorted path
  struct Staged {
    uint32_t offset;  // into staged_tokens_
    uint16_t len;
    End end;
  };
  std::vector<token_t> staged_tokens_;
  std::vector<Staged> staged_;
  std::vector<uint32_t> run_ends_;  // staged_ index where each run ends
  std::vector<float> run_weights_;
};

}  // namespace sssd
