// ContinuationTree: an owned weighted tree of token continuations.
//
// Two ways to fill it:
//  * add_path(): insert paths one by one (external drafts, tests); nodes
//    exist eagerly and siblings are found by a linear scan.
//  * stage() runs of continuations in suffix-array order, then
//    commit_runs(): the runs are merged into one sorted list and the tree is
//    LAZY: a node stands for the interval of sorted paths that share its
//    prefix, and its children are made only when expand() asks (the merger
//    expands the ~budget nodes it pops, not the ~M x branch_len nodes a full
//    tree would hold).
// Paths sharing a prefix share nodes, whose weights add up.
#pragma once

#include <cstdint>
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
  /// needed (the root's weight grows too). Eager trees only.
  void add_path(std::span<const token_t> tokens, float weight = 1.0f);

  /// Adds weight to the root only: an observation with no continuation.
  void add_empty(float weight = 1.0f) { nodes_[0].weight += weight; }

  /// Child of `parent` with `token`, created with weight 0 if absent. Eager trees only.
  uint32_t child(uint32_t parent, token_t token);

  /// How a staged continuation ended (it decides where it sorts among the
  /// paths it is a prefix of: a stream end sorts first, a separator last).
  enum class End : uint8_t { kStream = 0, kLength = 1, kSeparator = 2 };

  /// Stages one continuation (adding `weight` along its path) to the current
  /// sorted run: a sequence of continuations in suffix-array order. The
  /// tokens are referenced, not copied: they must outlive the tree's use
  /// (the datastore's mapped text does).
  void stage(std::span<const token_t> tokens, End end, float weight = 1.0f);
  /// Closes the current run.
  void end_run();
  /// Merges every staged run into suffix order and makes the lazy tree's
  /// root (its weight: every staged path's). Separator-ended paths will get
  /// an `end_token` child if >= 0. Summing the runs this way is the backoff
  /// merge.
  void commit_runs(int64_t end_token);
  /// Makes the children of `node`, once (no-op for eager trees).
  void expand(uint32_t node);
  /// Makes every node (for inspection and tests, not the hot path).
  void expand_all();

  const std::vector<TreeNode>& nodes() const { return nodes_; }
  std::vector<TreeNode>& nodes() { return nodes_; }
  float root_weight() const { return nodes_[0].weight; }

  /// View for the merger: probability of a node = weight / root weight.
  /// Lazy nodes are expanded through the view as the merger needs them.
  SourceTree view(Source source, int match_len, int max_depth);

 private:
  struct Staged {
    const token_t* tokens;  // borrowed
    uint16_t len;
    End end;
    float weight;
  };
  // Lazy node: paths order_[a..b) share its prefix of `depth` tokens.
  struct Span {
    uint32_t a, b;
    uint32_t depth;
    bool open;  // children not made yet
  };
  uint32_t add_node(uint32_t parent, token_t token, float weight);

  std::vector<TreeNode> nodes_;  // nodes_[0] is the root (its token is unused)
  std::vector<Span> spans_;      // parallel to nodes_ in a lazy tree, else empty
  std::vector<Staged> staged_;
  size_t staged_tokens_ = 0;  // total length of the staged paths
  std::vector<uint32_t> run_ends_;  // staged_ index where each run ends
  std::vector<uint32_t> order_;     // staged_ indices in suffix order
  std::vector<uint32_t> head_;      // merge scratch
  int64_t end_token_ = -1;
};

}  // namespace sssd
