// SuffixAutomaton: a request's own text indexed for its longest repeat.
//
// After each appended token, the longest suffix of the text that also ends
// somewhere earlier is known in O(1): it is the suffix link of the state of
// the whole text (Blumer et al. 1985; the incremental construction adds one
// state, sometimes a clone, and amortised O(1) transitions per token). No
// fixed context length: a 3-token match and a 3,000-token match are found the
// same way, which is what following a long verbatim copy needs.
//
// Where a suffix occurred: each state keeps the end positions of its most
// recent occurrences (kKeep, most recent first). Appending a token at
// position n adds n to the end positions of every state on the new state's
// suffix-link path; the first kTrack of them record it (the longest suffixes,
// the ones drafting asks about), so an append stays O(1) even when that path
// is long (one token repeated: the path is the whole text). A state further
// down the path keeps older positions: still occurrences, not the newest.
//
// Memory per token: at most 2 states (24 bytes each) and 3 transitions (a
// 12-byte edge plus its 16-byte slot in an open-addressing index kept under
// half full): at most 48 + 3 * 44 = 180 bytes per token; 60-100 on text. `max_tokens` caps it: past
// the cap the automaton stops growing and reports `capped()`; the text it
// indexed stays searchable, but it no longer ends where the request does.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "sssd/node_index.h"
#include "sssd/types.h"

namespace sssd {

class SuffixAutomaton {
 public:
  /// End positions kept per state (most recent first).
  static constexpr int kKeep = 3;
  /// States on the suffix-link path whose positions each append records.
  static constexpr int kTrack = 8;

  /// The longest suffix of the text that ended earlier too, and where.
  struct Repeat {
    uint32_t length = 0;            ///< tokens matched; 0: no repeat (or capped)
    int count = 0;                  ///< earlier end positions known (<= kKeep)
    uint32_t ends[kKeep] = {};      ///< index of the last matched token of each, most recent first
  };

  explicit SuffixAutomaton(size_t max_tokens = size_t(1) << 20);

  /// Appends one token (ignored once capped).
  void extend(token_t token);

  /// The longest repeated suffix of the text so far (none when capped).
  Repeat longest_repeat() const;

  size_t size() const { return n_; }
  bool capped() const { return capped_; }
  size_t num_states() const { return states_.size(); }
  size_t memory_bytes() const {
    return states_.capacity() * sizeof(State) + edges_.capacity() * sizeof(Edge) + index_.memory_bytes();
  }

  /// "" if every invariant holds (lengths, links, positions in range), else a message. Not for
  /// the hot path.
  std::string check_integrity() const;

 private:
  static constexpr uint32_t kNone = 0xffffffffu;
  struct State {
    uint32_t len;          // longest string of the state
    uint32_t link;         // suffix link (kNone for the root)
    uint32_t first_edge;   // the state's transitions, a list through Edge::next
    uint32_t ends[kKeep];  // most recent end positions, kNone-padded
  };
  struct Edge {
    token_t token;
    uint32_t target;
    uint32_t next;  // next edge of the same state
  };
  void record(State& s, uint32_t pos);
  uint32_t edge(uint32_t from, token_t token) const;  // the transition's edge, or kNoNode
  void add_edge(uint32_t from, token_t token, uint32_t target);

  std::vector<State> states_;
  std::vector<Edge> edges_;
  NodeIndex index_;  // (state, token) -> edge, for states with two or more transitions
  uint32_t last_ = 0;
  size_t n_ = 0;
  size_t max_tokens_;
  bool capped_ = false;
};

}  // namespace sssd
