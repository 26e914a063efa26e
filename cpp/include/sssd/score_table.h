// ScoreTable: how the merge turns a source's probability into a priority
// (paper, section 3.1.3).
//
// Sources differ in how well their probabilities predict acceptance (the
// input source is overconfident: a prefix seen twice in a prompt has few
// continuations), and within a source the reliability depends on how long
// the matched context was and how deep the candidate sits. So the priority
// of a candidate with source probability p is
//
//     factor(source, match_len, depth) * curve(source, match_len, depth)(p)
//
// where the factor is a discount (sssd.DiscountParams) and the optional
// curve is a monotone piecewise-linear calibration map fitted by `sssd
// calibrate` (predicted -> observed acceptance); without a curve, p itself.
// Cells are dense over (source, match length, depth); lengths and depths
// beyond the table's bounds use its last row / column.
#pragma once

#include <algorithm>
#include <vector>

#include "sssd/check.h"
#include "sssd/types.h"

namespace sssd {

/// A monotone non-decreasing piecewise-linear map (constant outside its knots).
struct Curve {
  std::vector<double> x;  ///< knots, strictly increasing
  std::vector<double> y;  ///< values, non-decreasing, same length as x (>= 1 knot)

  double operator()(double p) const {
    if (p <= x.front()) return y.front();
    if (p >= x.back()) return y.back();
    const size_t i = size_t(std::upper_bound(x.begin(), x.end(), p) - x.begin());  // x[i-1] <= p < x[i]
    const double t = (p - x[i - 1]) / (x[i] - x[i - 1]);
    return y[i - 1] + t * (y[i] - y[i - 1]);
  }
};

class ScoreTable {
 public:
  /// All discounts 1, no curves (raw probabilities).
  ScoreTable() : ScoreTable(1, 1, std::vector<double>(size_t(kNumSources) * 2 * 2, 1.0)) {}

  /// factors has num_sources * (max_match + 1) * (max_depth + 1) entries,
  /// laid out [source][match_len][depth]; all finite and >= 0. `curve_of`
  /// (same layout, or empty) names each cell's curve in `curves` (-1: none).
  /// Sources at or beyond num_sources use the last source's cells.
  ScoreTable(int max_match, int max_depth, std::vector<double> factors,
             std::vector<int32_t> curve_of = {}, std::vector<Curve> curves = {}, int num_sources = kNumSources)
      : max_match_(max_match), max_depth_(max_depth), num_sources_(num_sources), factors_(std::move(factors)),
        curve_of_(std::move(curve_of)), curves_(std::move(curves)) {
    SSSD_CHECK_ARG(max_match >= 0 && max_depth >= 1, "score table needs max_match >= 0 and max_depth >= 1");
    SSSD_CHECK_ARG(num_sources >= 1 && num_sources <= kMaxSources, "score table sources must be in [1, ",
                   kMaxSources, "], got ", num_sources);
    // In size_t: max_match + 1 overflows int for max_match = INT_MAX.
    const size_t cells = size_t(num_sources) * (size_t(max_match) + 1) * (size_t(max_depth) + 1);
    SSSD_CHECK_ARG(factors_.size() == cells, "score table has ", factors_.size(), " factors, expected ", cells);
    for (double f : factors_) {
      SSSD_CHECK_ARG(f >= 0 && f <= 1e30, "discount factors must be finite and >= 0, got ", f);
    }
    SSSD_CHECK_ARG(curve_of_.empty() || curve_of_.size() == cells, "curve_of has ", curve_of_.size(),
                   " cells, expected ", cells);
    for (int32_t c : curve_of_) {
      SSSD_CHECK_ARG(c >= -1 && c < int32_t(curves_.size()), "curve index ", c, " out of range");
    }
    for (const Curve& c : curves_) {
      SSSD_CHECK_ARG(!c.x.empty() && c.x.size() == c.y.size(), "a curve needs as many values as knots (>= 1)");
      for (size_t i = 0; i < c.x.size(); ++i) {
        SSSD_CHECK_ARG(c.y[i] >= 0 && c.y[i] <= 1e30 && (i == 0 || (c.x[i] > c.x[i - 1] && c.y[i] >= c.y[i - 1])),
                       "curves must have increasing knots and non-decreasing, finite, >= 0 values");
      }
    }
    // The highest priority each source's cells give (probabilities are <= 1, curves monotone).
    const size_t per_source = cells / size_t(num_sources);
    max_priority_.assign(size_t(num_sources), 0.0);
    for (size_t cell = 0; cell < cells; ++cell) {
      if (cell % (size_t(max_depth) + 1) == 0) continue;  // depth 0: never read
      const bool curved = !curve_of_.empty() && curve_of_[cell] >= 0;
      const double p = factors_[cell] * (curved ? curves_[size_t(curve_of_[cell])](1.0) : 1.0);
      double& m = max_priority_[cell / per_source];
      m = std::max(m, p);
    }
  }

  /// Priority of a candidate with source probability p.
  double priority(Source source, int match_len, int depth, double p) const {
    const size_t cell = this->cell(source, match_len, depth);
    if (!curve_of_.empty() && curve_of_[cell] >= 0) p = curves_[size_t(curve_of_[cell])](p);
    return factors_[cell] * p;
  }

  /// The discount factor alone (kept for tests and reports).
  double operator()(Source source, int match_len, int depth) const { return factors_[cell(source, match_len, depth)]; }

  /// An upper bound of priority(source, *, *, p) for every p <= 1.
  double max_priority(Source source) const { return max_priority_[size_t(std::min(int(source), num_sources_ - 1))]; }

  int max_match() const { return max_match_; }
  int max_depth() const { return max_depth_; }
  int num_sources() const { return num_sources_; }
  bool calibrated() const { return !curves_.empty(); }

 private:
  size_t cell(Source source, int match_len, int depth) const {
    const size_t s = size_t(std::min(int(source), num_sources_ - 1));
    const size_t m = size_t(std::clamp(match_len, 0, max_match_));
    const size_t d = size_t(std::clamp(depth, 1, max_depth_));
    return (s * (size_t(max_match_) + 1) + m) * (size_t(max_depth_) + 1) + d;
  }

  int max_match_;
  int max_depth_;
  int num_sources_;
  std::vector<double> factors_;
  std::vector<int32_t> curve_of_;
  std::vector<Curve> curves_;
  std::vector<double> max_priority_;  // per source
};

}  // namespace sssd
