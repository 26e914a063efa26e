// Datastore::validate(): the structural checks of a datastore's body.
//
// Headers and sizes are checked at every open (datastore.cpp); this checks
// what they cannot: that the token stream, the token index and the suffix
// array agree with each other. One pass over each file, parallel over
// chunks; each chunk notes its first problem and the lowest one is reported,
// so the message does not depend on the thread count.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "sssd/check.h"
#include "sssd/datastore.h"
#include "sssd/parallel.h"

namespace sssd {
namespace {

constexpr size_t kChunk = size_t(1) << 16;  // ranks / tokens per parallel work item
constexpr size_t kAhead = 48;               // suffix-array entries prefetched ahead

// The first problem found in one chunk: where (to report the lowest) and what.
struct Finding {
  size_t at = std::numeric_limits<size_t>::max();
  std::string what;
  void note(size_t pos, std::string message) {
    if (pos < at) {
      at = pos;
      what = std::move(message);
    }
  }
};

void throw_lowest(const std::vector<Finding>& found) {
  const auto it = std::min_element(found.begin(), found.end(),
                                   [](const Finding& a, const Finding& b) { return a.at < b.at; });
  if (it != found.end() && !it->what.empty()) throw CorruptFile(it->what + "; rebuild the datastore");
}

std::string token_name(token_t t) {
  return t == kSeparator ? std::string("the separator") : detail::concat("token ", t);
}

// Restores random-access advice on the mapped files however validation ends.
struct AdviceGuard {
  const Bytes* files[2];
  ~AdviceGuard() {
    for (const Bytes* b : files) b->advise(MADV_RANDOM);
  }
};

}  // namespace

void Datastore::validate(int num_threads) const {
  const int threads = resolve_threads(num_threads);
  // Every page is read once, in order: let the kernel read ahead.
  AdviceGuard guard{{&tokens_bytes_, &suffix_bytes_}};
  for (const Bytes* b : guard.files) b->advise(MADV_SEQUENTIAL);
  validate_tokens(threads);
  validate_index();
  validate_suffix_array(threads);
}

void Datastore::validate_tokens(int threads) const {
  const std::string file = dir_ + "/" + kTokensFile;
  const StreamStats st = stream_stats(tokens(), threads);
  const uint64_t vocab = header_.vocab_size;
  if (st.vocab_size > vocab) {
    // Find the first id outside the vocabulary, to name it (error path only).
    const size_t chunks = (n_ + kChunk - 1) / kChunk;
    std::vector<Finding> found(chunks);
    parallel_for(chunks, threads, [&](size_t c) {
      for (size_t i = c * kChunk, end = std::min(n_, i + kChunk); i < end; ++i) {
        if (text_[i] != kSeparator && text_[i] >= vocab) {
          found[c].note(i, detail::concat(file, ": corrupt: token id ", text_[i], " at position ", i,
                                          " is outside the vocabulary (its header's vocab_size is ", vocab, ")"));
          return;
        }
      }
    });
    throw_lowest(found);
  }
  SSSD_CHECK_AS(CorruptFile, st.vocab_size == vocab, file, ": corrupt: its header's vocab_size is ", vocab,
                " but its largest token id is ", int64_t(st.vocab_size) - 1, "; rebuild the datastore");
  SSSD_CHECK_AS(CorruptFile, st.num_docs == header_.num_docs, file, ": corrupt: the stream holds ", st.num_docs,
                " documents but its header says ", header_.num_docs, "; rebuild the datastore");
  SSSD_CHECK_AS(CorruptFile, st.fingerprint == header_.fingerprint, file,
                ": corrupt: the token stream does not match the fingerprint in its header; rebuild the datastore");
}

void Datastore::validate_index() const {
  if (!first_) return;  // no index (sparse ids): searches use the whole array
  const std::string file = dir_ + "/" + kTokenIndexFile;
  const size_t vocab = size_t(header_.vocab_size);
  SSSD_CHECK_AS(CorruptFile, first_[0] == 0, file, ": corrupt: entry 0 is ", first_[0],
                ", expected 0; rebuild the datastore");
  for (size_t t = 0; t < vocab; ++t) {
    SSSD_CHECK_AS(CorruptFile, first_[t] <= first_[t + 1], file, ": corrupt: entry ", t + 1, " (", first_[t + 1],
                  ") is below entry ", t, " (", first_[t], "); entries must not decrease; rebuild the datastore");
  }
  // The ranks after entry vocab_size are the separator-initial suffixes.
  // (The header's document count was checked against the stream.)
  const uint64_t separators = header_.num_docs - (n_ > 0 && text_[n_ - 1] != kSeparator ? 1 : 0);
  SSSD_CHECK_AS(CorruptFile, n_ - first_[vocab] == separators, file, ": corrupt: entry ", vocab, " (", first_[vocab],
                ") leaves ", n_ - first_[vocab], " separator-initial suffixes, but the stream has ", separators,
                " separators; rebuild the datastore");
}

void Datastore::validate_suffix_array(int threads) const {
  const std::string file = dir_ + "/" + kSuffixArrayFile;
  const std::string index_file = dir_ + "/" + kTokenIndexFile;
  const size_t vocab = size_t(header_.vocab_size);
  auto entry = [&](size_t r) -> size_t {
    if (index_bytes_ == 4) {
      uint32_t v;
      std::memcpy(&v, sa_ + r * 4, 4);
      return v;
    }
    uint64_t v;
    std::memcpy(&v, sa_ + r * 8, 8);
    return size_t(v);
  };
  // Suffix order (as the sort defines it: the stream's end lowest, the
  // separator highest; two suffixes that reach a separator together compare
  // on past it, or, in datastores written before (kSuffixOrderByPosition),
  // by position) decided within kValidateOrderTokens tokens: <0, >0, or 0
  // when undecided.
  const bool by_position = suffix_order_ == kSuffixOrderByPosition;
  auto order = [&](size_t a, size_t b) -> int {
    for (size_t k = 0; k < kValidateOrderTokens; ++k) {
      const bool end_a = a + k >= n_, end_b = b + k >= n_;
      if (end_a || end_b) return end_a ? -1 : 1;
      const token_t x = text_[a + k], y = text_[b + k];
      if (x != y) return x < y ? -1 : 1;
      if (x == kSeparator && by_position) return a < b ? -1 : 1;
    }
    return 0;
  };

  const size_t chunks = (n_ + kChunk - 1) / kChunk;
  std::vector<Finding> found(chunks);
  std::atomic<size_t> undecided{0};
  parallel_for(chunks, threads, [&](size_t c) {
    const size_t lo = c * kChunk, hi = std::min(n_, lo + kChunk);
    // The token whose index range holds rank lo (first_[0] == 0 <= lo).
    size_t t = first_ ? size_t(std::upper_bound(first_, first_ + vocab + 1, uint64_t(lo)) - first_) - 1 : 0;
    size_t local_undecided = 0;
    for (size_t r = lo; r < hi; ++r) {
      if (r + kAhead < n_) {  // the first two cache lines of a suffix cover most comparisons
        const size_t ahead = entry(r + kAhead);
        if (ahead < n_) __builtin_prefetch(text_ + ahead);
        if (ahead + 16 < n_) __builtin_prefetch(text_ + ahead + 16);
      }
      const size_t a = entry(r);
      if (a >= n_) {
        found[c].note(r, detail::concat(file, ": corrupt: entry ", r, " = ", a, " is outside the stream of ", n_,
                                        " tokens"));
        return;
      }
      if (first_) {
        while (t < vocab && first_[t + 1] <= r) ++t;
        const token_t want = t < vocab ? token_t(t) : kSeparator;
        if (text_[a] != want) {
          found[c].note(r, detail::concat(index_file, " and ", file, " disagree (corrupt): the index puts rank ", r,
                                          " among the suffixes starting with ", token_name(want),
                                          ", but the suffix there (position ", a, ") starts with ",
                                          token_name(text_[a])));
          return;
        }
      }
      if (r + 1 < n_) {
        const size_t b = entry(r + 1);
        if (b >= n_) continue;  // reported at rank r + 1
        const int o = order(a, b);
        if (a == b || o > 0) {
          found[c].note(r, a == b ? detail::concat(file, ": corrupt: entries ", r, " and ", r + 1,
                                                   " both hold position ", a)
                                  : detail::concat(file, ": corrupt: the suffixes at ranks ", r, " and ", r + 1,
                                                   " (positions ", a, " and ", b, ") are out of order"));
          return;
        }
        local_undecided += o == 0;
      }
    }
    undecided.fetch_add(local_undecided, std::memory_order_relaxed);
  });
  throw_lowest(found);

  // Strictly increasing entries are distinct; where a long repeat left a
  // pair undecided, check distinctness directly (n entries < n, all
  // distinct: a permutation).
  if (undecided.load() == 0) return;
  std::vector<std::atomic<uint64_t>> seen((n_ + 63) / 64);
  parallel_for(chunks, threads, [&](size_t c) {
    for (size_t r = c * kChunk, end = std::min(n_, r + kChunk); r < end; ++r) {
      const size_t a = entry(r);
      const uint64_t bit = uint64_t(1) << (a % 64);
      if (seen[a / 64].fetch_or(bit, std::memory_order_relaxed) & bit) {
        found[c].note(r, detail::concat(file, ": corrupt: position ", a, " appears twice (again at rank ", r, ")"));
        return;
      }
    }
  });
  throw_lowest(found);
}

}  // namespace sssd
