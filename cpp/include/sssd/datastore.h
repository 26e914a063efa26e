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
// The backoff is computed without searching every level: occurrence counts
// fall as the suffix grows, so one binary search over lengths finds the
// "base" level (the longest suffix with >= min_occurrences occurrences).
// Every longer level has fewer than min_occurrences <= max_samples
// occurrences, all taken, and each is an occurrence of the base+1 suffix;
// so the levels above the base are exactly the base+1 suffix's occurrences,
// each weighted by how many levels it belongs to (how far the context
// matches backwards there). Same tree as sampling level by level.
//
// A Datastore is immutable after construction: every const method is safe to
// call concurrently from many threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "sssd/continuation_tree.h"
#include "sssd/coro.h"
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
  int branch_len = 16;           ///< continuation length of short matches (tree depth), >= 1
  /// Adaptive depth: an occurrence whose context matches m tokens continues
  /// for clamp(branch_per_match * m, branch_len, max_branch_len) tokens, so
  /// a long (near-verbatim) match is followed deep and a short one is not.
  /// 0: every continuation is branch_len long.
  double branch_per_match = 0;
  int max_branch_len = 16;       ///< cap of the adaptive length (at least branch_len), <= 255
  /// Weight of a longer match: the level of a context suffix ell tokens
  /// above the base level weighs match_boost^ell base samples (1: every
  /// level counts its occurrences once, the plain backoff sum). Above 1, the
  /// few occurrences that match far back dominate the tree, as a longest-match
  /// drafter's would, while short matches still back off.
  double match_boost = 1;
  int64_t end_token = -1;        ///< drafted where a document ends (e.g. EOS); -1: none

  /// Continuation length for an occurrence matching `match` context tokens.
  int branch_for(int match) const {
    if (!(branch_per_match > 0)) return branch_len;
    const double want = branch_per_match * double(match);
    return want >= double(deepest()) ? deepest() : std::max(branch_len, int(want));
  }
  /// The longest continuation any occurrence gets (the tree's depth).
  int deepest() const { return branch_per_match > 0 ? std::max(branch_len, max_branch_len) : branch_len; }
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
  /// Maps `dir`/tokens.bin, suffix_array.bin and token_index.bin. Checks
  /// headers, sizes and that the files describe the same stream (throws
  /// sssd::Error), then, if `validate`, their structure (validate()). Without
  /// validation, opening reads nothing else and a corrupt body can only give
  /// exceptions or meaningless (but well-formed) trees, never a crash.
  static std::shared_ptr<const Datastore> open(const std::string& dir, bool validate = true,
                                               int num_threads = 0);

  /// Checks the whole structure in one parallel pass over each file, and
  /// throws CorruptFile naming the file and the first inconsistency found:
  ///  - tokens.bin: every id is < the header's vocab_size or the separator,
  ///    and the stream matches the header's vocab_size, document count and
  ///    fingerprint;
  ///  - token_index.bin: starts at 0, never decreases, and leaves exactly the
  ///    separator-initial suffixes after entry vocab_size;
  ///  - suffix_array.bin: every entry is < size(); the suffix at each rank
  ///    starts with the token whose index range holds the rank; adjacent
  ///    suffixes are in strictly increasing order. Order is decided within
  ///    kValidateOrderTokens tokens; pairs sharing a longer prefix (long
  ///    repeats) are not compared further, and entries are then also
  ///    checked to be distinct, so the array is a permutation.
  /// Reads every byte of the three files: seconds for billions of tokens.
  void validate(int num_threads = 0) const;

  /// Tokens compared per adjacent pair of suffixes by validate().
  static constexpr size_t kValidateOrderTokens = 16;

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
  /// The raw suffix array (index_bytes() wide entries, aligned), for tools.
  const uint8_t* suffix_array_data() const { return sa_; }

  // Residency of the mapped files (an in-memory datastore is always
  // resident). A cold page costs a fault (from disk: a major one) inside a
  // query; benchmarks/bench_residency.py measures what that costs.
  /// Reads every page of the mapped files in, so that later queries take no
  /// page faults until the kernel reclaims them. Returns the bytes read in.
  size_t warm() const;
  /// Pins every page in memory (mlock) for the datastore's lifetime; the
  /// kernel cannot reclaim them. Throws sssd::Error if the lockable-memory
  /// limit (RLIMIT_MEMLOCK) is too low, saying how to raise it. Returns bytes.
  size_t lock() const;
  /// Asks the kernel to reclaim the unlocked pages now, as memory pressure
  /// would (MADV_PAGEOUT). Returns false where the kernel cannot.
  bool page_out() const;
  /// Bytes of the three files now in memory.
  size_t resident_bytes() const;

  /// Start position of the suffix of rank `r`. Throws std::out_of_range if
  /// r >= size(), CorruptFile if the stored entry is out of range (a corrupt
  /// suffix array).
  size_t suffix(size_t r) const;

  /// [lo, hi): ranks of the suffixes that start with `pattern` (no separators).
  std::pair<size_t, size_t> find(std::span<const token_t> pattern) const;

  /// True if `pattern` occurs.
  bool occurs(std::span<const token_t> pattern) const;

  /// Builds the continuation tree for `context` into `out` (cleared first).
  QueryStats query(std::span<const token_t> context, const DatastoreQuery& params,
                   ContinuationTree& out) const;

  /// The same query as a coroutine, for interleaving many queries with
  /// run_interleaved() (see coro.h): each waits on its cache misses while the
  /// others run. `context` and `*out` must outlive the task.
  Task<QueryStats> query_task(std::span<const token_t> context, DatastoreQuery params,
                              ContinuationTree* out) const;

 private:
  Datastore(Bytes tokens, Bytes suffixes, Bytes index, const std::string& where);
  // <0, 0, >0: suffix at `pos` is below, starts with, or is above `pattern`.
  int compare(size_t pos, std::span<const token_t> pattern) const;
  // [lo, hi) of the suffixes whose first token is t (needs the index).
  std::pair<size_t, size_t> first_token_range(token_t t) const;
  // Where a search for `pattern` starts: its first token's range and offset
  // 1 with the index, else the whole array and offset 0.
  struct Start {
    size_t lo, hi, offset;
  };
  Start start(std::span<const token_t> pattern) const;
  // [lo, hi) within [first, last) whose suffixes, `offset` tokens in (they
  // all share their first `offset` tokens), start with `pattern`.
  std::pair<size_t, size_t> find_in(size_t first, size_t last, std::span<const token_t> pattern,
                                    size_t offset) const;
  // First rank in [lo, hi) whose suffix, `offset` tokens in, is >= rest (> if upper).
  Task<size_t> bound(size_t lo, size_t hi, std::span<const token_t> rest, size_t offset,
                     bool upper) const;
  // Lower bound of `pattern`, and whether it occurs at least `need` times.
  struct Bound {
    size_t lower = 0;
    bool enough = false;
  };
  Task<Bound> at_least(std::span<const token_t> pattern, size_t need) const;
  // Stages the continuation starting at text position `start` (it ends at a
  // separator, the stream's end or branch_len tokens) into `out`.
  void stage_continuation(size_t start, int branch_len, float weight, ContinuationTree& out) const;
  // Stages (as one sorted run of `out`, each path weighing `weight`) up to
  // q.max_samples continuations of the range [first, last) of the context's
  // suffix of length `len`, at regular intervals; each continues for
  // q.branch_for(how far back, up to `longest`, the context matches there).
  Task<bool> sample(size_t first, size_t last, int len, int longest, std::span<const token_t> context,
                    DatastoreQuery q, float weight, ContinuationTree* out) const;
  // How many context tokens, from `len` up to `longest`, match backwards
  // from the occurrence of the context's len-suffix at text position `pos`.
  int match_at(size_t pos, int len, int longest, std::span<const token_t> context) const;
  // Stages the continuations of every occurrence in [first, last) of the
  // context's suffix of length len, each weighing the number of context
  // suffixes of length in [len, longest] that occur there.
  struct Weighted {
    int match_len = 0;         // longest match among the occurrences
    uint64_t occurrences = 0;  // occurrences reaching it
    uint32_t samples = 0;      // sum of weights (= samples of the levels)
  };
  Task<Weighted> stage_weighted(size_t first, size_t last, int len, int longest,
                                std::span<const token_t> context, DatastoreQuery q,
                                ContinuationTree* out) const;
  // The backoff level by level (for min_occurrences > max_samples).
  QueryStats query_levels(std::span<const token_t> context, const DatastoreQuery& q,
                          ContinuationTree& out) const;

  // validate()'s passes; each throws CorruptFile.
  void validate_tokens(int threads) const;
  void validate_index() const;
  void validate_suffix_array(int threads) const;

  std::string dir_;  // where the files are (for messages), "<memory>" if built in memory
  Bytes tokens_bytes_, suffix_bytes_, token_index_bytes_;
  FileHeader header_{};
  const token_t* text_ = nullptr;
  const uint8_t* sa_ = nullptr;
  const uint64_t* first_ = nullptr;  // first-token index (vocab_size + 1 entries) or null
  size_t n_ = 0;
  int index_bytes_ = 4;
  uint8_t suffix_order_ = kSuffixOrderSeparatorSymbol;  // how its separators sort (file_format.h)
};

/// Validates query parameters; throws std::invalid_argument naming the field.
void check_query(const DatastoreQuery& q);

}  // namespace sssd
