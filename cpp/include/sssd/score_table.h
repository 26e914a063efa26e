// ScoreTable: the per-source discounts of the merge (paper, section 3.1.3).
//
// A candidate's priority is its source probability times
// discount(source, match_len, depth). Sources differ in how well their
// probabilities predict acceptance (the input source is overconfident: a
// prefix seen twice in a prompt has few continuations), and within a source
// the reliability depends on how long the matched context was and how deep
// the candidate sits. The table is dense over (source, match length, depth);
// lengths and depths beyond its bounds use its last row / column. Its values
// come from sssd.DiscountParams (parametric defaults) or from the
// calibration tool.
#pragma once

#include <vector>

#include "sssd/check.h"
#include "sssd/types.h"

namespace sssd {

class ScoreTable {
 public:
  /// All discounts 1 (raw probabilities).
  ScoreTable() : ScoreTable(1, 1, std::vector<double>(size_t(kNumSources) * 2 * 2, 1.0)) {}

  /// factors has kNumSources * (max_match + 1) * (max_depth + 1) entries,
  /// laid out [source][match_len][depth]; all finite and >= 0.
  ScoreTable(int max_match, int max_depth, std::vector<double> factors)
      : max_match_(max_match), max_depth_(max_depth), factors_(std::move(factors)) {
    SSSD_CHECK_ARG(max_match >= 0 && max_depth >= 1, "score table needs max_match >= 0 and max_depth >= 1");
    SSSD_CHECK_ARG(factors_.size() == size_t(kNumSources) * size_t(max_match + 1) * size_t(max_depth + 1),
                   "score table has ", factors_.size(), " factors, expected ",
                   size_t(kNumSources) * size_t(max_match + 1) * size_t(max_depth + 1));
    for (double f : factors_) {
      SSSD_CHECK_ARG(f >= 0 && f <= 1e30, "discount factors must be finite and >= 0, got ", f);
    }
  }

  double operator()(Source source, int match_len, int depth) const {
    const size_t m = size_t(match_len < max_match_ ? match_len : max_match_);
    const size_t d = size_t(depth < max_depth_ ? depth : max_depth_);
    return factors_[(size_t(source) * size_t(max_match_ + 1) + m) * size_t(max_depth_ + 1) + d];
  }

  int max_match() const { return max_match_; }
  int max_depth() const { return max_depth_; }
  const std::vector<double>& factors() const { return factors_; }

 private:
  int max_match_;
  int max_depth_;
  std::vector<double> factors_;
};

}  // namespace sssd
