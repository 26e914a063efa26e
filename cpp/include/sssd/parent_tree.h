// Trees given as parent-pointer arrays (the wire format of draft trees):
// node i hangs under node parents[i], or under the root when it is -1, and a
// parent always precedes its children. One place checks such arrays and one
// builds continuation trees from them; the drafter's external candidates,
// the test merge entry point and best_chains all go through here.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "sssd/continuation_tree.h"
#include "sssd/types.h"

namespace sssd {

/// Throws std::invalid_argument (naming `what`) unless every parents[i] is -1
/// or in [0, i).
void check_parents(std::span<const int32_t> parents, std::string_view what);

/// How the weights given for parent-pointer nodes combine along a path.
enum class PathWeight : uint8_t {
  kAbsolute = 0,     ///< weights[i] is the weight of the path to node i
  kConditional = 1,  ///< weights[i] is p(token_i | parent's path): path weight = product
};

/// Adds node i of a parent-pointer tree to `tree` (an eager ContinuationTree),
/// given the tree nodes of the earlier input nodes in `ids` (ids[parents[i]]),
/// and records its tree node in ids[i]. The weight is set as `mode` says
/// (`path[i]` receives the path weight, for the conditional mode's children).
/// Nodes carrying the same token under the same parent share a tree node.
inline void add_parent_node(ContinuationTree& tree, std::span<const token_t> tokens, std::span<const int32_t> parents,
                            std::span<const float> weights, PathWeight mode, size_t i, std::vector<uint32_t>& ids,
                            std::vector<double>& path) {
  const int32_t p = parents[i];
  const uint32_t parent_node = p < 0 ? 0 : ids[size_t(p)];
  const uint32_t id = tree.child(parent_node, tokens[i]);
  ids[i] = id;
  path[i] = mode == PathWeight::kConditional ? (p < 0 ? 1.0 : path[size_t(p)]) * double(weights[i])
                                             : double(weights[i]);
  tree.nodes()[id].weight = float(path[i]);
}

/// Fills `tree` (cleared first) from a whole parent-pointer tree; returns the
/// tree node of every input node.
std::vector<uint32_t> build_from_parents(ContinuationTree& tree, std::span<const token_t> tokens,
                                         std::span<const int32_t> parents, std::span<const float> weights,
                                         PathWeight mode);

}  // namespace sssd
