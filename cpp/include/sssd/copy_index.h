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
//
// Edits: when the copy rejoins its source, what it wrote instead of what the
// source had is remembered (the last kEdits of them): source tokens removed,
// tokens inserted, and the source token before them. Code edits repeat
// themselves (a renamed variable, a changed indentation, a constant), so a
// copy path read from the source also comes in an edited version, every
// remembered edit applied where the source has it again; the draft branches
// between the two.
//
// An edit of four or more removed tokens also applies where the source has
// them again with at most two tokens changed between the same first and last
// ones: a file read with numbered lines and written back without them removes
// "\n", spaces, the line's digits and " |" before every line, and only the
// digits differ from line to line (line numbers, counters, ids). Where the
// output writes a remembered edit at the cursor's site (and no long repeat
// points elsewhere), the cursor moves on past the site's removed tokens as
// the edit's insertion ends: the copy goes on reading the source across it,
// as it does over copied tokens.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

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
  /// Where a resync found the context again: its last `length` tokens end at `end`.
  struct Resync {
    uint32_t length = 0;  ///< 0: not found
    uint32_t end = 0;
  };
  /// A remembered edit: where the source had `anchor` then `removed`, the copy wrote `anchor`
  /// then `inserted`. With `removed` empty it is an insertion after `anchor`; otherwise the
  /// removed tokens alone locate it.
  struct Edit {
    token_t anchor;
    std::vector<token_t> removed, inserted;
    double applied = 1, skipped = 0;  ///< sites of it the copy passed since, edited or not (the first: edited)

    /// The probability that the copy edits the next site too (a prior of half an application
    /// and one and a half skips: a fresh edit is even odds).
    double odds() const { return (applied + 0.5) / (applied + skipped + 2.0); }
  };
  /// Tokens searched after the cursor for a resync, the most matched, and how near the cursor
  /// one token is enough.
  static constexpr uint32_t kWindow = 64, kResyncMax = 8, kNear = 3;
  /// Edits remembered, and the longest side of one.
  static constexpr size_t kEdits = 8, kEditMax = 32;
  /// An edit removing at least kFuzzyMin tokens also applies to a site with the same first and
  /// last tokens and at most kFuzzyMismatch others changed.
  static constexpr size_t kFuzzyMin = 4, kFuzzyMismatch = 2;
  static constexpr uint32_t kNoCursor = 0xffffffffu;

  /// max_tokens: the automaton's cap (0: no copy source); min_match: shortest repeat that
  /// predicts; half_life: trials after which evidence weighs half.
  CopyIndex(size_t max_tokens, int min_match, double half_life);

  /// Appends `token` to a text whose tokens so far are `text`.
  void append(std::span<const token_t> text, token_t token);

  /// The context's longest suffix (up to kResyncMax tokens) that ends within kWindow tokens after
  /// the cursor (and before the context's end), the nearest among equals; one token is enough
  /// within kNear tokens of the cursor (a token replaced in place), elsewhere two. Right after
  /// the output wrote a remembered edit at the cursor's site (the context ends with its
  /// insertion, not with source tokens): the cursor itself, as a match of kResyncMax tokens.
  Resync resync(std::span<const token_t> context) const;

  /// Whether the removed tokens `removed` (not empty) are at position `j` of `text`: exactly, or
  /// by the fuzzy rule above.
  static bool removed_at(const std::vector<token_t>& removed, std::span<const token_t> text, size_t j);

  /// The source read from `start` for up to `depth` tokens into `out` (cleared first): an
  /// overlapping copy where it runs into the context's end (periodic text goes on with its
  /// period); with `edited`, every remembered edit applied where the source has it again
  /// (most recent first), and the path stops at the context's end.
  /// Returns the first edit applied (nullptr: none).
  const Edit* follow(std::span<const token_t> context, size_t start, size_t depth, bool edited,
                     std::vector<token_t>& out) const;

  /// The longest repeated suffix of the text (length 0 if none, disabled or capped).
  SuffixAutomaton::Repeat repeat() const { return enabled_ ? sam_.longest_repeat() : SuffixAutomaton::Repeat{}; }

  /// The probability that a copy continues one more token: the evidence blended with a prior
  /// worth `pseudo` trials.
  double rate(double prior, double pseudo) const { return (hits_ + prior * pseudo) / (trials_ + pseudo); }

  double hits() const { return hits_; }
  double trials() const { return trials_; }
  /// The copy's reading position (kNoCursor: none yet).
  uint32_t cursor() const { return cursor_; }
  bool aligned() const { return aligned_; }
  const std::vector<Edit>& edits() const { return edits_; }
  bool enabled() const { return enabled_; }
  const SuffixAutomaton& automaton() const { return sam_; }
  size_t memory_bytes() const;

 private:
  Resync resync_from(std::span<const token_t> context, uint32_t cursor) const;
  void count_site(std::span<const token_t> text, token_t token);
  void remember(std::span<const token_t> text, token_t token, uint32_t source_end, uint32_t matched);
  /// The output left the source at the cursor's site with `token`: does it write a remembered
  /// edit there? Sets the pending insertion (or realigns at once); false if no edit starts so.
  bool start_edit(std::span<const token_t> text, token_t token);
  /// Whether `e` is at the cursor's site: an insertion's anchor at the cursor, or its removed
  /// tokens right after it.
  bool at_cursor_site(const Edit& e, std::span<const token_t> text) const;

  SuffixAutomaton sam_;
  bool enabled_;
  int min_match_;
  double decay_;
  double hits_ = 0, trials_ = 0;
  uint32_t cursor_ = kNoCursor;
  bool aligned_ = false;          // the output follows the cursor (else it diverged there)
  uint32_t diverged_at_ = 0;      // text position of the first token that left the source
  std::vector<Edit> edits_;       // most recent first
  // An edit the output is writing at the cursor's site: the insertion's tokens still to come
  // (from pending_pos_), and the source position the cursor moves to when they are written.
  std::vector<token_t> pending_;
  size_t pending_pos_ = 0;
  uint32_t pending_cursor_ = 0;
  bool via_edit_ = false;  // aligned by an edit just written (the context ends with its insertion)
};

}  // namespace sssd
