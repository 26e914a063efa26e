#include "sssd/parent_tree.h"

#include "sssd/check.h"

namespace sssd {

void check_parents(std::span<const int32_t> parents, std::string_view what) {
  for (size_t i = 0; i < parents.size(); ++i) {
    const int32_t p = parents[i];
    SSSD_CHECK_ARG(p >= -1 && int64_t(p) < int64_t(i), what, ": parent[", i, "] = ", p,
                   " must be -1 or an earlier node of the same tree");
  }
}

std::vector<uint32_t> build_from_parents(ContinuationTree& tree, std::span<const token_t> tokens,
                                         std::span<const int32_t> parents, std::span<const float> weights,
                                         PathWeight mode) {
  SSSD_CHECK_ARG(parents.size() == tokens.size() && weights.size() == tokens.size(),
                 "tokens, parents and weights differ in length");
  check_parents(parents, "tree");
  tree.clear();
  std::vector<uint32_t> ids(tokens.size());
  std::vector<double> path(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) add_parent_node(tree, tokens, parents, weights, mode, i, ids, path);
  return ids;
}

}  // namespace sssd
