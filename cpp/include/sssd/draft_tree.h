// DraftTree: one request's draft, as flat arrays (the wire format to Python
// and to the verifier).
//
// Node i is a candidate token; the tree's root is the last token of the
// context and is not stored. Nodes are in insertion order, so a parent always
// precedes its children (parents[i] < i). A node's score is the priority it
// was inserted with; scores steer tree building only.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "sssd/types.h"

namespace sssd {

struct DraftTree {
  std::vector<token_t> tokens;      ///< [n] candidate token ids
  std::vector<int32_t> parents;     ///< [n] parent node, -1 for children of the root
  std::vector<int32_t> depths;      ///< [n] 1 for children of the root
  std::vector<float> scores;        ///< [n] priority at insertion (discounted / calibrated probability)
  std::vector<float> probs;         ///< [n] the inserting source's raw path probability
  std::vector<uint8_t> match_lens;  ///< [n] context tokens that source matched (0: external)
  std::vector<uint8_t> sources;     ///< [n] Source that inserted the node
  std::vector<float> draft_probs;   ///< [n] q(token | parent) from a model source, NaN if none

  size_t size() const { return tokens.size(); }
  void clear() {
    tokens.clear();
    parents.clear();
    depths.clear();
    scores.clear();
    probs.clear();
    match_lens.clear();
    sources.clear();
    draft_probs.clear();
  }
};

/// The drafts of a batch concatenated (CSR): request b owns entries
/// [offsets[b], offsets[b+1]) of every array of `nodes`.
struct DraftBatch {
  std::vector<int64_t> offsets;  ///< [B + 1]
  DraftTree nodes;               ///< [N] concatenated; parents stay request-local
};

/// Concatenates per-request drafts.
DraftBatch concat(const std::vector<DraftTree>& trees);

/// Nodes of the chain with the largest sum of scores (the chain's expected
/// accepted length when scores are calibrated acceptance probabilities),
/// root side first. Ties go to the earlier-inserted node.
std::vector<int32_t> best_chain(const int32_t* parents, const float* scores, size_t n);

/// best_chain() of every tree of a batch in CSR form (tree b owns entries
/// [offsets[b], offsets[b+1]) of parents and scores; parents are tree-local).
/// Returns (offsets, nodes) in the same form. Throws std::invalid_argument
/// unless offsets start at 0, never decrease and end at parents.size() ==
/// scores.size(), and every parent is -1 or an earlier node of its tree;
/// everything is checked before anything is read.
std::pair<std::vector<int64_t>, std::vector<int32_t>> best_chains(std::span<const int64_t> offsets,
                                                                  std::span<const int32_t> parents,
                                                                  std::span<const float> scores);

}  // namespace sssd
