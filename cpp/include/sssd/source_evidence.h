// SourceEvidence: each request's own acceptance by source (sssd/source_evidence.py).
//
// The merge ranks candidates by their source's calibrated score, fitted over
// many requests; requests differ. Per open request and source tag this keeps
// what the request's drafted candidates were expected to get and what they
// got, and turns it into the merge's per-request factors (SourceFactors):
//
//   scale = (observed + prior) / (expected + prior) over depth-1 candidates,
//           each expected to be accepted with its score;
//   level = the same over deeper candidates whose parent was accepted, each
//           expected to follow its parent with its conditional odds (its
//           score over its parent's, the parent of the same source), counted
//           only at odds >= level_floor;
//
// clipped to their bounds. Expected counts use the scores without the
// request's factors (divided out), so the factors do not feed on themselves.
// Evidence decays by half every `half_life` scored steps.
//
// A drafted tree is kept (drafted) until the request's next tokens come
// (extended), and scored only if they directly follow the context it was
// drafted for: a candidate at depth d is right iff its path equals the next d
// tokens; candidates deeper than the tokens, or under a wrong parent, are not
// counted (verified or not: the emitted tokens decide).
//
// Thread-safe: one mutex.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "sssd/types.h"

namespace sssd {

struct EvidenceSettings {
  double prior = 2.0;        ///< the calibration's weight, in expected acceptances (> 0)
  double half_life = 16.0;   ///< scored steps after which evidence weighs half (> 0)
  double level_floor = 0.3;  ///< deeper candidates count at conditional odds >= this
  float scale_lo = 0.25f, scale_hi = 4.0f;
  float level_lo = 0.5f, level_hi = 1.5f;
};

/// One draft call's trees (a DraftBatch's arrays), as the evidence reads them.
struct DraftedTrees {
  std::span<const int64_t> offsets;  ///< [n + 1]
  std::span<const int64_t> tokens;
  std::span<const int32_t> parents;  ///< request-local, -1: a child of the root
  std::span<const int32_t> depths;
  std::span<const uint8_t> sources;
  std::span<const float> scores;
};

class SourceEvidence {
 public:
  /// observed and expected at depth 1, then observed and expected deeper, per source tag.
  using Counts = std::array<double, 4 * kMaxSources>;

  explicit SourceEvidence(EvidenceSettings settings);

  /// Starts (or restarts) request `id` with a context of `length` tokens.
  void open(uint64_t id, size_t length);
  /// Forgets request `id` (unknown ids: nothing).
  void close(uint64_t id);
  bool contains(uint64_t id) const;
  size_t size() const;
  /// Throws std::invalid_argument for an unknown id.
  Counts counts(uint64_t id) const;

  /// out[b * kMaxSources + s] = (scale, level) of request ids[b] and source s; 1 for unknown ids.
  void factors(std::span<const uint64_t> ids, std::span<float> out) const;

  /// Keeps `trees` (drafted with `factors`, [n * kMaxSources * 2] or empty: all 1) for requests
  /// ids[b] whose contexts were lengths[b] tokens long. Throws std::invalid_argument for malformed
  /// trees (checked before any request changes).
  void drafted(std::span<const uint64_t> ids, std::span<const int64_t> lengths, const DraftedTrees& trees,
               std::span<const float> factors);

  /// Request ids[b]'s next tokens are tokens[offsets[b] .. offsets[b + 1]): its kept tree, if
  /// drafted at this context, is scored by them. Unknown ids are skipped.
  void extended(std::span<const uint64_t> ids, std::span<const int64_t> offsets, std::span<const token_t> tokens);

  const EvidenceSettings& settings() const { return settings_; }

 private:
  struct Request {
    size_t length = 0;
    Counts counts{};
    bool pending = false;  // a kept tree waits for the next tokens
    size_t drafted_at = 0;
    std::vector<token_t> tokens;
    std::vector<int32_t> parents, depths;
    std::vector<uint8_t> sources;
    std::vector<float> expected;  // NaN: not counted
    std::vector<uint8_t> matched;
  };
  void observe(Request& r, std::span<const token_t> next);

  EvidenceSettings settings_;
  double decay_;
  std::unordered_map<uint64_t, Request> requests_;
  mutable std::mutex mu_;
};

}  // namespace sssd
