// CopyIndex: what the copy source knows of one request (issue 28).
//
// Copy-heavy requests (code edits, agent loops, quoting) write long runs of
// text they have seen earlier in the same request. The copy source follows
// the longest earlier occurrence of the context's suffix (SuffixAutomaton: no
// fixed context length), as far as the evidence allows: how far is decided
// by how well such predictions have done on this request's own text.
//
// Evidence: before each appended token, if the text's longest repeat is at
// least `min_match` tokens long, its most recent earlier occurrence predicts
// the next token (the one that followed it); whether the appended token is
// that one is a trial. Hits and trials decay with a half-life in trials, so
// a request that stops copying loses its rate within a few dozen tokens. The
// rate a draft uses is (hits + prior * pseudo) / (trials + pseudo): the
// prior (calibrated) until the request has shown what it does. Every token
// of the text counts, prompt and output alike, so a draft is a function of
// the text alone (a stateless draft of the same context gets the same rate).
// In greedy decoding the rate is exactly the acceptance rate of a copy chain's
// next token; it never changes what is accepted, only what is drafted.
//
// The cursor: where in the text the copy is reading. A long repeat sets it
// (the end of its most recent earlier occurrence); each appended token that
// is the one after the cursor moves it on. An edit (a token the source does
// not have next) leaves it where the copy diverged, and `resync` looks for the
// context's last few tokens in the source just after it: an edit rejoins the
// text it edits within a few tokens, long before a new repeat is long enough
// to be trusted on its own (prompt lookup's n-gram matching finds such short
// matches anywhere; near the cursor they are far less ambiguous).
#pragma once

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <span>

#include "sssd/suffix_automaton.h"
#include "sssd/types.h"

namespace sssd {

/// How a request's copy index is kept (max_tokens 0: none).
struct CopySettings {
  size_t max_tokens = 0;
  int min_match = 8;
  double half_life = 32;
};

class CopyIndex {
 public:
  /// max_tokens: the automaton's cap (0: no copy source); min_match: shortest repeat that
  /// predicts; half_life: trials after which evidence weighs half.
  CopyIndex(size_t max_tokens, int min_match, double half_life)
      : sam_(max_tokens), enabled_(max_tokens > 0), min_match_(min_match),
        decay_(half_life > 0 ? std::exp2(-1.0 / half_life) : 0.0) {}

  /// Where a resync found the context again: its last `length` tokens end at `end`.
  struct Resync {
    uint32_t length = 0;  ///< 0: not found
    uint32_t end = 0;
  };
  /// Tokens searched after the cursor for a resync, and the most matched.
  static constexpr uint32_t kWindow = 64, kResyncMax = 8, kNear = 3;

  /// Appends `token` to a text whose tokens so far are `text`.
  void append(std::span<const token_t> text, token_t token) {
    if (!enabled_) return;
    const SuffixAutomaton::Repeat r = sam_.longest_repeat();
    if (r.length >= uint32_t(min_match_) && r.count > 0) {
      hits_ = decay_ * hits_ + (text[r.ends[0] + 1] == token ? 1.0 : 0.0);
      trials_ = decay_ * trials_ + 1.0;
    }
    const bool follows = cursor_ != kNoCursor && size_t(cursor_) + 1 < text.size() && text[cursor_ + 1] == token;
    sam_.extend(token);
    const SuffixAutomaton::Repeat now = sam_.longest_repeat();
    if (now.length >= uint32_t(min_match_) && now.count > 0) {
      cursor_ = now.ends[0];
    } else if (follows) {
      ++cursor_;
    }
  }

  /// The context's longest suffix (up to kResyncMax tokens) that ends within kWindow tokens after
  /// the cursor (and before the context's end), the nearest among equals; one token is enough
  /// within kNear tokens of the cursor (a token replaced in place), elsewhere two.
  Resync resync(std::span<const token_t> context) const {
    Resync best;
    if (!enabled_ || cursor_ == kNoCursor || context.size() < 2) return best;
    const size_t n = context.size();
    const size_t last = std::min(n - 2, size_t(cursor_) + kWindow);
    for (size_t e = cursor_; e <= last; ++e) {
      uint32_t m = 0;
      while (m < kResyncMax && m <= e && context[e - m] == context[n - 1 - m] && e - m != n - 1 - m) ++m;
      if (m > best.length && (m >= 2 || e <= size_t(cursor_) + kNear)) best = {m, uint32_t(e)};
    }
    return best;
  }

  /// The longest repeated suffix of the text (length 0 if none, disabled or capped).
  SuffixAutomaton::Repeat repeat() const { return enabled_ ? sam_.longest_repeat() : SuffixAutomaton::Repeat{}; }

  /// The probability that a copy continues one more token: the evidence blended with a prior
  /// worth `pseudo` trials.
  double rate(double prior, double pseudo) const { return (hits_ + prior * pseudo) / (trials_ + pseudo); }

  double hits() const { return hits_; }
  /// The copy's reading position (kNoCursor: none yet).
  uint32_t cursor() const { return cursor_; }
  static constexpr uint32_t kNoCursor = 0xffffffffu;
  double trials() const { return trials_; }
  bool enabled() const { return enabled_; }
  const SuffixAutomaton& automaton() const { return sam_; }
  size_t memory_bytes() const { return sam_.memory_bytes(); }

 private:
  SuffixAutomaton sam_;
  bool enabled_;
  int min_match_;
  double decay_;
  double hits_ = 0, trials_ = 0;
  uint32_t cursor_ = kNoCursor;
};

}  // namespace sssd
