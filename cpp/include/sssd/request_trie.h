// RequestTrie: the per-request "input" source (paper, section 3.1.1).
//
// A trie of every n-gram (n <= max_depth) of the request's prompt and
// generated tokens, with occurrence counts, updated incrementally: appending
// one token touches at most max_depth nodes. For each match length L the
// node of the context's last L tokens is kept at hand (`tail_`), so a
// continuation tree for L costs no walk: its root is that node and the
// continuations are its descendants, up to max_depth - L tokens deep.
//
// Child lookup: a node with one child is checked in place (its first child's
// token); only the children of nodes with two or more go in the child index.
// Most of a request's nodes are n-grams seen once, chains of only children,
// so the index holds a fraction of the nodes and stays cache-sized, which is
// most of what appending a token costs.
//
// Memory: at most max_depth new nodes per token; a node costs 16 bytes, plus
// 32-64 bytes in the child index (kept under half full) for the children of
// branching nodes, at most ~100 bytes with vector growth. Worst case (no
// n-gram ever repeats) that is 100 * max_depth bytes per token: 4 MB for a
// 2,000-token request at the default depth 20; real text needs much less
// (measured: benchmarks/RESULTS.md, "What a request's copy index costs").
// `max_nodes` caps it: past the cap, new n-grams are no longer added
// (existing ones keep counting). The whole trie is freed when its request
// is closed.
//
// Beside the n-grams, the request's copy index (copy_index.h): its longest
// repeat of any length and how well repeats have predicted its text, for the
// copy source that follows long verbatim matches past max_depth.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "sssd/copy_index.h"
#include "sssd/node_index.h"
#include "sssd/tree_node.h"

namespace sssd {

class RequestTrie {
 public:
  /// max_depth >= 2: longest n-gram stored (= longest match + continuation).
  explicit RequestTrie(int max_depth, size_t max_nodes = size_t(1) << 24, CopySettings copy = CopySettings());

  /// Appends tokens to the request's context.
  void extend(std::span<const token_t> tokens);

  /// View of the continuations of the context's last `len` tokens
  /// (1 <= len < max_depth): root = that n-gram's node, probability of a node
  /// = its count / the n-gram's occurrences that have a next token (all but
  /// the one at the very end of the context). Empty if len > size() or
  /// nothing follows.
  SourceTree continuations(int len) const;

  size_t size() const { return tokens_.size(); }
  std::span<const token_t> tokens() const { return tokens_; }
  size_t num_nodes() const { return nodes_.size(); }
  const CopyIndex& copy() const { return copy_; }
  int max_depth() const { return max_depth_; }
  size_t memory_bytes() const;

  /// Walks the trie and returns "" if every invariant holds, else a message
  /// (children sum <= parent count, index consistent, depth bound). Not for
  /// the hot path.
  std::string check_integrity() const;

 private:
  uint32_t child(uint32_t parent, token_t token);  // get or create (kNoNode if capped)

  int max_depth_;
  size_t max_nodes_;
  std::vector<token_t> tokens_;
  std::vector<TreeNode> nodes_;  // nodes_[0] is the root; weight = occurrences
  NodeIndex index_;
  std::vector<uint32_t> tail_;  // tail_[k]: node of the last k+1 tokens (kNoNode if capped)
  CopyIndex copy_;
};

}  // namespace sssd
