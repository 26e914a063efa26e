// Datastore: a token stream and its suffix array (paper, section 3.1.2).
//
// Given the last tokens of a context, `query` finds the suffix-array range of
// each context suffix by binary search, samples at most `max_samples`
// continuations at regular intervals across the range (the array is sorted,
// so this is a stratified sample of the continuations, unlike taking the
// first M), and backs off to shorter suffixes while the occurrences seen are
// below a threshold, summing the continuations of every level used into one
// weighted tree. No continuation crosses a document separator.
//
// A Datastore is immutable after construction: every const method is safe to
// call concurrently from many threads.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "sssd/continuation_tree.h"
#include "sssd/file_format.h"
#include "sssd/mapped_file.h"
#include "sssd/suffix_sort.h"

namespace sssd {

/// Retrieval parameters of the datastore source.
struct DatastoreQuery {
  int max_match = 16;            ///< longest context suffix searched (tokens), >= 1
  int min_match = 1;             ///< shortest context suffix searched, in [1, max_match]
  uint32_t max_samples = 100;    ///< M: continuations sampled per context suffix, >= 1
  uint64_t min_occurrences = 20; ///< back off to shorter suffixes while occurrences < this
  int branch_len = 16;           ///< longest continuation (tree depth), >= 1
  int64_t end_token = -1;        ///< drafted where a document ends (e.g. EOS); -1: none
};

/// A request's memory of its previous query, so that the next one can narrow
/// the old suffix-array ranges instead of searching from scratch. When the
/// context grew by k tokens, the suffix of length L + k extends the old
/// suffix of length L: its range lies inside the old one, found by a binary
/// search over the new tokens only. The longest match can also grow by at
/// most k, which bounds the search when the extension fails.
struct MatchCache {
  size_t context_len = 0;  ///< context length at the previous query (0: nothing cached)
  int match_len = 0;       ///< longest matching suffix then
  /// ranges[j]: suffix-array range of the suffix of length match_len - j
  std::vector<std::pair<size_t, size_t>> ranges;
  void clear() {
    context_len = 0;
    match_len = 0;
    ranges.clear();
  }
};

/// What a query found.
struct QueryStats {
  int match_len = 0;         ///< longest context suffix that occurs (0: none)
  uint64_t occurrences = 0;  ///< occurrences of that longest suffix
  int levels = 0;            ///< suffix lengths merged into the tree
  uint32_t samples = 0;      ///< continuations inserted
};

class Datastore {
 public:
  /// Maps `dir`/tokens.bin and `dir`/suffix_array.bin. Checks headers, sizes
  /// and that both files describe the same stream; reads nothing else, so the
  /// cost does not depend on the datastore's size. Throws sssd::Error.
  static std::shared_ptr<const Datastore> open(const std::string& dir);

  /// Builds a datastore in memory (for tests and small corpora).
  static std::shared_ptr<const Datastore> from_tokens(std::span<const token_t> tokens,
                                                      int num_threads = 0);

  /// Builds the suffix array of `tokens` and writes both files into the
  /// existing directory `dir`. Suffix indices are 32-bit below 2^32 - 2
  /// tokens, else 64-bit. Throws sssd::Error on I/O failure (e.g. disk full).
  static void write(std::span<const token_t> tokens, const std::string& dir, int num_threads = 0,
                    const SortProgress& progress = {});

  size_t size() const { return n_; }
  uint64_t vocab_size() const { return header_.vocab_size; }
  uint64_t num_docs() const { return header_.num_docs; }
  uint64_t fingerprint() const { return header_.fingerprint; }
  int index_bytes() const { return index_bytes_; }
  bool mapped() const { return tokens_bytes_.mapped(); }
  std::span<const token_t> tokens() const { return {text_, n_}; }

  /// Start position of the suffix of rank `r` (< size()). Throws sssd::Error
  /// if the stored entry is out of range (a corrupt suffix array).
  size_t suffix(size_t r) const;

  /// [lo, hi): ranks of the suffixes that start with `pattern` (no separators).
  std::pair<size_t, size_t> find(std::span<const token_t> pattern) const {
    return find_in(0, n_, pattern, 0);
  }

  /// True if `pattern` occurs (stops at the first hit).
  bool occurs(std::span<const token_t> pattern) const;

  /// Builds the continuation tree for `context` into `out` (cleared first).
  /// With `cache` (one per request, used by one thread at a time), reuses
  /// and then updates the request's previous ranges; the context must have
  /// grown only by appending since the cache was filled.
  QueryStats query(std::span<const token_t> context, const DatastoreQuery& params,
                   ContinuationTree& out, MatchCache* cache = nullptr) const;

 private:
  Datastore(Bytes tokens, Bytes suffixes, const std::string& where);
  // <0, 0, >0: suffix at `pos` is below, starts with, or is above `pattern`.
  int compare(size_t pos, std::span<const token_t> pattern) const;
  // [lo, hi) within [first, last) whose suffixes, `offset` tokens in (they
  // all share their first `offset` tokens), start with `pattern`.
  std::pair<size_t, size_t> find_in(size_t first, size_t last, std::span<const token_t> pattern,
                                    size_t offset) const;
  // Stages (as one sorted run of `out`) up to q.max_samples continuations of
  // the range [first, last) of a suffix of length `len`, at regular intervals.
  void sample(size_t first, size_t last, int len, const DatastoreQuery& q,
              ContinuationTree& out) const;

  Bytes tokens_bytes_, suffix_bytes_;
  FileHeader header_{};
  const token_t* text_ = nullptr;
  const uint8_t* sa_ = nullptr;
  size_t n_ = 0;
  int index_bytes_ = 4;
};

/// Validates query parameters; throws std::invalid_argument naming the field.
void check_query(const DatastoreQuery& q);

}  // namespace sssd
