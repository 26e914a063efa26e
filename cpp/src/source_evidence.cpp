#include "sssd/source_evidence.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "sssd/check.h"
#include "sssd/parent_tree.h"

namespace sssd {

SourceEvidence::SourceEvidence(EvidenceSettings settings) : settings_(settings) {
  const EvidenceSettings& s = settings_;
  SSSD_CHECK_ARG(s.prior > 0 && std::isfinite(s.prior), "prior must be > 0, got ", s.prior);
  SSSD_CHECK_ARG(s.half_life > 0 && std::isfinite(s.half_life), "half_life must be > 0, got ", s.half_life);
  SSSD_CHECK_ARG(s.level_floor >= 0 && s.level_floor <= 1, "level_floor must be in [0, 1], got ", s.level_floor);
  SSSD_CHECK_ARG(s.scale_lo >= 0 && s.scale_lo <= 1 && s.scale_hi >= 1 && std::isfinite(s.scale_hi),
                 "scale bounds must be lo in [0, 1] and hi >= 1, got (", s.scale_lo, ", ", s.scale_hi, ")");
  SSSD_CHECK_ARG(s.level_lo >= 0 && s.level_lo <= 1 && s.level_hi >= 1 && std::isfinite(s.level_hi),
                 "level bounds must be lo in [0, 1] and hi >= 1, got (", s.level_lo, ", ", s.level_hi, ")");
  decay_ = std::pow(0.5, 1.0 / s.half_life);
}

void SourceEvidence::open(uint64_t id, size_t length) {
  std::lock_guard lock(mu_);
  Request& r = requests_[id];
  r.length = length;
  r.counts.fill(0);
  r.pending = false;
}

void SourceEvidence::close(uint64_t id) {
  std::lock_guard lock(mu_);
  requests_.erase(id);
}

bool SourceEvidence::contains(uint64_t id) const {
  std::lock_guard lock(mu_);
  return requests_.count(id) != 0;
}

size_t SourceEvidence::size() const {
  std::lock_guard lock(mu_);
  return requests_.size();
}

SourceEvidence::Counts SourceEvidence::counts(uint64_t id) const {
  std::lock_guard lock(mu_);
  const auto it = requests_.find(id);
  SSSD_CHECK_ARG(it != requests_.end(), "request ", id, " is not open");
  return it->second.counts;
}

void SourceEvidence::factors(std::span<const uint64_t> ids, std::span<float> out) const {
  SSSD_CHECK_ARG(out.size() == ids.size() * kMaxSources * 2, "factors: expected ", ids.size() * kMaxSources * 2,
                 " entries, got ", out.size());
  const EvidenceSettings& s = settings_;
  std::lock_guard lock(mu_);
  for (size_t b = 0; b < ids.size(); ++b) {
    float* row = out.data() + b * kMaxSources * 2;
    const auto it = requests_.find(ids[b]);
    for (int src = 0; src < kMaxSources; ++src) {
      float scale = 1, level = 1;
      if (it != requests_.end()) {
        const Counts& c = it->second.counts;
        scale = float(std::clamp((c[src] + s.prior) / (c[kMaxSources + src] + s.prior), double(s.scale_lo),
                                 double(s.scale_hi)));
        level = float(std::clamp((c[2 * kMaxSources + src] + s.prior) / (c[3 * kMaxSources + src] + s.prior),
                                 double(s.level_lo), double(s.level_hi)));
      }
      row[2 * src] = scale;
      row[2 * src + 1] = level;
    }
  }
}

void SourceEvidence::drafted(std::span<const uint64_t> ids, std::span<const int64_t> lengths,
                             const DraftedTrees& t, std::span<const float> factors) {
  const size_t n = ids.size();
  SSSD_CHECK_ARG(lengths.size() == n, "lengths: expected ", n, " (one per request), got ", lengths.size());
  SSSD_CHECK_ARG(t.offsets.size() == n + 1 && t.offsets.front() == 0, "offsets must have ", n + 1,
                 " entries starting at 0");
  const size_t total = size_t(t.offsets.back());
  SSSD_CHECK_ARG(t.tokens.size() == total && t.parents.size() == total && t.depths.size() == total &&
                     t.sources.size() == total && t.scores.size() == total,
                 "tokens, parents, depths, sources and scores must have offsets[-1] = ", total, " entries");
  SSSD_CHECK_ARG(factors.empty() || factors.size() == n * kMaxSources * 2, "factors must have ",
                 n * kMaxSources * 2, " entries (or none)");
  for (size_t b = 0; b < n; ++b) {
    SSSD_CHECK_ARG(t.offsets[b] <= t.offsets[b + 1], "offsets must be non-decreasing");
    const size_t lo = size_t(t.offsets[b]), hi = size_t(t.offsets[b + 1]);
    check_parents(t.parents.subspan(lo, hi - lo), "evidence trees");
    for (size_t j = lo; j < hi; ++j) {
      SSSD_CHECK_ARG(t.sources[j] < kMaxSources, "source tag ", int(t.sources[j]), " is not below ", kMaxSources);
      const int32_t p = t.parents[j];
      SSSD_CHECK_ARG(t.depths[j] == (p < 0 ? 1 : t.depths[lo + size_t(p)] + 1), "depths[", j,
                     "] is not its parent's plus one");
    }
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::lock_guard lock(mu_);
  for (size_t b = 0; b < n; ++b) {
    const auto it = requests_.find(ids[b]);
    if (it == requests_.end()) continue;
    Request& r = it->second;
    const size_t lo = size_t(t.offsets[b]), hi = size_t(t.offsets[b + 1]);
    r.pending = hi > lo && lengths[b] >= 0 && size_t(lengths[b]) == r.length;
    if (!r.pending) continue;
    r.drafted_at = r.length;
    const size_t m = hi - lo;
    r.tokens.resize(m);
    r.parents.assign(t.parents.begin() + lo, t.parents.begin() + hi);
    r.depths.assign(t.depths.begin() + lo, t.depths.begin() + hi);
    r.sources.assign(t.sources.begin() + lo, t.sources.begin() + hi);
    r.expected.resize(m);
    const float* f = factors.empty() ? nullptr : factors.data() + b * kMaxSources * 2;
    for (size_t j = 0; j < m; ++j) {
      const int64_t token = t.tokens[lo + j];
      // A token id outside token_t never equals an emitted token.
      r.tokens[j] = token >= 0 && token <= int64_t(kMaxTokenId) ? token_t(token) : kSeparator;
      const int32_t p = r.parents[j];
      const int src = r.sources[j];
      const double score = t.scores[lo + j];
      double e;
      if (p < 0) {
        e = score / (f ? double(f[2 * src]) : 1.0);
      } else if (r.sources[size_t(p)] != src) {
        e = nan;  // a parent of another source says nothing of this source's odds
      } else {
        e = score / (double(t.scores[lo + size_t(p)]) * (f ? double(f[2 * src + 1]) : 1.0));
      }
      r.expected[j] = std::isfinite(e) ? float(std::min(e, 1.0)) : nan;
    }
  }
}

void SourceEvidence::extended(std::span<const uint64_t> ids, std::span<const int64_t> offsets,
                              std::span<const token_t> tokens) {
  check_offsets(offsets, ids.size(), tokens.size());
  std::lock_guard lock(mu_);
  for (size_t b = 0; b < ids.size(); ++b) {
    const auto it = requests_.find(ids[b]);
    if (it == requests_.end()) continue;
    Request& r = it->second;
    const auto next = tokens.subspan(size_t(offsets[b]), size_t(offsets[b + 1] - offsets[b]));
    if (next.empty()) continue;
    if (r.pending && r.drafted_at == r.length) observe(r, next);
    r.pending = false;
    r.length += next.size();
  }
}

void SourceEvidence::observe(Request& r, std::span<const token_t> next) {
  const size_t m = r.tokens.size();
  r.matched.assign(m, 0);
  Counts add{};
  for (size_t j = 0; j < m; ++j) {  // parents precede children
    const int32_t p = r.parents[j];
    const size_t d = size_t(r.depths[j]);
    if (d > next.size() || (p >= 0 && !r.matched[size_t(p)])) continue;
    const bool right = r.tokens[j] == next[d - 1];
    r.matched[j] = right;
    const float e = r.expected[j];
    if (std::isnan(e)) continue;
    const int src = r.sources[j];
    if (p < 0) {
      add[src] += right;
      add[kMaxSources + src] += e;
    } else if (e >= settings_.level_floor) {
      add[2 * kMaxSources + src] += right;
      add[3 * kMaxSources + src] += e;
    }
  }
  // Every scored step weighs the evidence before it down, whatever it counted.
  for (size_t i = 0; i < add.size(); ++i) r.counts[i] = r.counts[i] * decay_ + add[i];
}

}  // namespace sssd
