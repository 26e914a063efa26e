// Suffix sort against a brute-force sort of the suffixes.
//
// The order (suffix_sort.h): token ids ascending, the separator above every
// token (one symbol: suffixes that share a separator go on comparing past
// it); the end of the stream below everything. Streams cover small and large alphabets (the dense and
// the sparse symbol paths), long repeats (many doubling rounds), separators,
// both index widths and 1-2 threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

#include "sssd/suffix_sort.h"

namespace sssd {
namespace {

// True if the suffix at a sorts before the one at b (a != b).
bool suffix_less(const std::vector<token_t>& t, size_t a, size_t b) {
  for (size_t k = 0;; ++k) {
    const bool end_a = a + k >= t.size(), end_b = b + k >= t.size();
    if (end_a || end_b) return end_a;  // both cannot end at once: a != b
    const token_t x = t[a + k], y = t[b + k];
    if (x != y) return x < y;  // kSeparator is the largest id
  }
}

std::vector<size_t> brute_force(const std::vector<token_t>& t) {
  std::vector<size_t> sa(t.size());
  std::iota(sa.begin(), sa.end(), size_t(0));
  std::sort(sa.begin(), sa.end(), [&](size_t a, size_t b) { return suffix_less(t, a, b); });
  return sa;
}

template <typename Index>
void expect_sorted_like_brute_force(const std::vector<token_t>& t, int threads) {
  std::vector<Index> sa(t.size());
  build_suffix_array<Index>(t, sa, threads);
  const auto want = brute_force(t);
  ASSERT_EQ(sa.size(), want.size());
  for (size_t r = 0; r < sa.size(); ++r) {
    ASSERT_EQ(size_t(sa[r]), want[r]) << "rank " << r << " of " << t.size() << " tokens, " << threads << " threads";
  }
}

std::vector<token_t> random_stream(std::mt19937_64& rng, size_t n, uint32_t alphabet, double sep_rate, bool huge_ids) {
  std::uniform_int_distribution<uint32_t> tok(0, alphabet - 1);
  std::bernoulli_distribution sep(sep_rate);
  std::vector<token_t> t(n);
  for (auto& x : t) {
    x = sep(rng) ? kSeparator : tok(rng);
    if (huge_ids && x != kSeparator) x = x * 97'000'003u % kMaxTokenId;  // sparse ids
  }
  return t;
}

TEST(SuffixSort, MatchesBruteForceOnRandomStreams) {
  std::mt19937_64 rng(12345);
  for (int round = 0; round < 60; ++round) {
    const size_t n = std::uniform_int_distribution<size_t>(0, 1500)(rng);
    const uint32_t alphabet = std::array<uint32_t, 5>{1, 2, 5, 300, 70'000}[round % 5];
    const double sep_rate = std::array<double, 3>{0.0, 0.02, 0.3}[round % 3];
    const auto t = random_stream(rng, n, alphabet, sep_rate, /*huge_ids=*/round % 7 == 0);
    for (int threads : {1, 2}) {
      expect_sorted_like_brute_force<uint32_t>(t, threads);
      expect_sorted_like_brute_force<uint64_t>(t, threads);
    }
  }
}

TEST(SuffixSort, MatchesBruteForceOnLongRepeats) {
  // Periodic text: suffixes tie for up to n tokens (log n doubling rounds).
  std::mt19937_64 rng(7);
  for (size_t period : {1, 2, 3, 17}) {
    for (size_t reps : {1, 50, 400}) {
      std::vector<token_t> unit = random_stream(rng, period, 4, 0.0, false);
      std::vector<token_t> t;
      for (size_t r = 0; r < reps; ++r) t.insert(t.end(), unit.begin(), unit.end());
      if (reps == 50) t.push_back(kSeparator);  // one separator at the end
      for (int threads : {1, 2}) expect_sorted_like_brute_force<uint32_t>(t, threads);
    }
  }
}

TEST(SuffixSort, SeparatorsOnlyAndTinyStreams) {
  for (const auto& t : std::vector<std::vector<token_t>>{
           {}, {5}, {kSeparator}, {kSeparator, kSeparator, kSeparator}, {0, kSeparator, 0}, {3, 3}, {kMaxTokenId, 0}}) {
    expect_sorted_like_brute_force<uint32_t>(t, 2);
  }
}

TEST(SuffixSort, RejectsASizeMismatch) {
  const std::vector<token_t> t{1, 2, 3};
  std::vector<uint32_t> sa(2);
  EXPECT_THROW(build_suffix_array<uint32_t>(t, sa, 1), std::invalid_argument);
}

TEST(SuffixSort, AnExceptionFromTheProgressCallbackReachesTheCaller) {
  // The callback runs between rounds on the calling thread; its exception
  // must come out of build_suffix_array, not terminate the process.
  std::vector<token_t> t(5000, 1);
  std::vector<uint32_t> sa(t.size());
  EXPECT_THROW(build_suffix_array<uint32_t>(t, sa, 2, [](size_t, size_t) { throw std::runtime_error("stop"); }),
               std::runtime_error);
}

}  // namespace
}  // namespace sssd
