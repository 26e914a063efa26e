#include "sssd/suffix_sort.h"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "libsais.h"
#include "libsais16.h"
#include "libsais64.h"
#include "sssd/check.h"
#include "sssd/parallel.h"

namespace sssd {
namespace {

// libsais's parallel entry points exist only when it is built with OpenMP.
#ifdef LIBSAIS_OPENMP
int64_t sort16(const uint16_t* t, int32_t* sa, int32_t n, int threads) {
  return libsais16_omp(t, sa, n, 0, nullptr, threads);
}
int64_t sort32(int32_t* t, int32_t* sa, int32_t n, int32_t k, int threads) {
  return libsais_int_omp(t, sa, n, k, 0, threads);
}
int64_t sort64(int64_t* t, int64_t* sa, int64_t n, int64_t k, int threads) {
  return libsais64_long_omp(t, sa, n, k, 0, threads);
}
#else
int64_t sort16(const uint16_t* t, int32_t* sa, int32_t n, int) { return libsais16(t, sa, n, 0, nullptr); }
int64_t sort32(int32_t* t, int32_t* sa, int32_t n, int32_t k, int) { return libsais_int(t, sa, n, k, 0); }
int64_t sort64(int64_t* t, int64_t* sa, int64_t n, int64_t k, int) { return libsais64_long(t, sa, n, k, 0); }
#endif

// The dense symbol of every token id that occurs, in id order: rank[t] from
// a table over the ids when they are dense enough, else from the sorted
// distinct ids. The separator is symbol K (the number of distinct ids),
// above every token.
struct Alphabet {
  std::vector<uint32_t> table;
  std::vector<token_t> ids;
  size_t size = 0;  // K: distinct token ids
  uint64_t symbol(token_t t) const {
    if (t == kSeparator) return size;
    return table.empty() ? uint64_t(std::lower_bound(ids.begin(), ids.end(), t) - ids.begin()) : table[t];
  }
};

Alphabet alphabet_of(std::span<const token_t> text, int threads) {
  const size_t n = text.size();
  token_t max_id = 0;
#pragma omp parallel for reduction(max : max_id) num_threads(threads)
  for (size_t i = 0; i < n; ++i) {
    if (text[i] != kSeparator && text[i] > max_id) max_id = text[i];
  }
  Alphabet a;
  if (size_t(max_id) <= 4 * n + (size_t(1) << 20)) {
    std::vector<uint8_t> present(size_t(max_id) + 1, 0);
    for (size_t i = 0; i < n; ++i) {
      if (text[i] != kSeparator) present[text[i]] = 1;
    }
    a.table.resize(present.size());
    for (size_t t = 0; t < present.size(); ++t) {
      a.table[t] = uint32_t(a.size);
      a.size += present[t];
    }
  } else {
    a.ids.reserve(n);
    for (token_t t : text) {
      if (t != kSeparator) a.ids.push_back(t);
    }
    std::sort(a.ids.begin(), a.ids.end());
    a.ids.erase(std::unique(a.ids.begin(), a.ids.end()), a.ids.end());
    a.size = a.ids.size();
  }
  return a;
}

// The stream as libsais's alphabet [0, K]: K + 1 symbols, the separator the
// largest; libsais's implicit end of stream sorts below every symbol, as
// ours does.
template <typename Symbol>
void rewrite(std::span<const token_t> text, const Alphabet& a, std::vector<Symbol>& out, int threads) {
  const size_t n = text.size();
  out.resize(n);
#pragma omp parallel for num_threads(threads)
  for (size_t i = 0; i < n; ++i) out[i] = Symbol(a.symbol(text[i]));
}

}  // namespace

template <typename Index>
void build_suffix_array(std::span<const token_t> text, std::span<Index> sa, int num_threads,
                        const SortProgress& progress) {
  const size_t n = text.size();
  SSSD_CHECK_ARG(sa.size() == n, "suffix array size ", sa.size(), " != text size ", n);
  SSSD_CHECK_ARG(n < size_t(std::numeric_limits<Index>::max()) - 1, "stream of ", n,
                 " tokens is too long for ", sizeof(Index) * 8, "-bit suffix indices");
  if (progress) progress(0, n);
  if (n <= 1) {
    if (n == 1) sa[0] = 0;
    if (progress) progress(n, n);
    return;
  }
  const int threads = resolve_threads(num_threads);
  int64_t rc = 0;
  const Alphabet a = alphabet_of(text, threads);
  const int64_t k = int64_t(a.size) + 1;  // the tokens and the separator
  if (std::is_same_v<Index, uint32_t> && n <= size_t(std::numeric_limits<int32_t>::max())) {
    // 32-bit: the caller's array is libsais's output (no free space after
    // it, fs = 0). With at most 2^16 symbols (vocabularies below 65,535 ids)
    // the 16-bit sort, about 1.4x faster; else the integer-alphabet one.
    // Peak extra memory: the 2- or 4-byte symbol copy of the stream.
    int32_t* out = reinterpret_cast<int32_t*>(sa.data());
    if (k <= (int64_t(1) << 16)) {
      std::vector<uint16_t> symbols;
      rewrite(text, a, symbols, threads);
      rc = sort16(symbols.data(), out, int32_t(n), threads);
    } else {
      std::vector<int32_t> symbols;
      rewrite(text, a, symbols, threads);
      rc = sort32(symbols.data(), out, int32_t(n), int32_t(k), threads);
    }
  } else {
    // 64-bit (or a 32-bit array past 2^31 tokens): libsais64 over 8-byte
    // symbols; a 32-bit result goes through an 8-byte buffer.
    std::vector<int64_t> symbols;
    rewrite(text, a, symbols, threads);
    if constexpr (std::is_same_v<Index, uint64_t>) {
      rc = sort64(symbols.data(), reinterpret_cast<int64_t*>(sa.data()), int64_t(n), k, threads);
    } else {
      std::vector<int64_t> wide(n);
      rc = sort64(symbols.data(), wide.data(), int64_t(n), k, threads);
      std::copy(wide.begin(), wide.end(), sa.begin());
    }
  }
  // -2: libsais could not allocate its work space; -1: it refused its arguments.
  if (rc == -2) throw std::bad_alloc();
  SSSD_CHECK(rc == 0, "suffix sort failed (libsais returned ", rc, ")");
  if (progress) progress(n, n);
}

template void build_suffix_array<uint32_t>(std::span<const token_t>, std::span<uint32_t>, int,
                                           const SortProgress&);
template void build_suffix_array<uint64_t>(std::span<const token_t>, std::span<uint64_t>, int,
                                           const SortProgress&);

}  // namespace sssd
