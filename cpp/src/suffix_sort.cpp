#include "sssd/suffix_sort.h"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "libsais.h"
#include "libsais64.h"
#include "sssd/check.h"
#include "sssd/parallel.h"

namespace sssd {
namespace {

// libsais's parallel entry points exist only when it is built with OpenMP.
#ifdef LIBSAIS_OPENMP
int64_t sort32(int32_t* t, int32_t* sa, int32_t n, int32_t k, int threads) {
  return libsais_int_omp(t, sa, n, k, 0, threads);
}
int64_t sort64(int64_t* t, int64_t* sa, int64_t n, int64_t k, int threads) {
  return libsais64_long_omp(t, sa, n, k, 0, threads);
}
#else
int64_t sort32(int32_t* t, int32_t* sa, int32_t n, int32_t k, int) { return libsais_int(t, sa, n, k, 0); }
int64_t sort64(int64_t* t, int64_t* sa, int64_t n, int64_t k, int) { return libsais64_long(t, sa, n, k, 0); }
#endif

// Rewrites the stream as libsais's integer alphabet [0, k): token ids keep
// their order as dense symbols 0..K-1, and the j-th separator becomes
// K + j. Returns k. Distinct separators ordered by position above every
// token give exactly our order (suffix_sort.h), and libsais's implicit end
// of stream sorts below every symbol, as ours does.
template <typename Symbol>
int64_t integer_alphabet(std::span<const token_t> text, std::vector<Symbol>& out, int threads) {
  const size_t n = text.size();
  token_t max_id = 0;
#pragma omp parallel for reduction(max : max_id) num_threads(threads)
  for (size_t i = 0; i < n; ++i) {
    if (text[i] != kSeparator && text[i] > max_id) max_id = text[i];
  }
  // rank[t]: the dense symbol of token id t (a table over the ids when they
  // are dense enough, else binary search over the sorted distinct ids).
  std::vector<uint32_t> table;
  std::vector<token_t> ids;
  size_t num_tokens = 0;
  if (size_t(max_id) <= 4 * n + (size_t(1) << 20)) {
    std::vector<uint8_t> present(size_t(max_id) + 1, 0);
    for (size_t i = 0; i < n; ++i) {
      if (text[i] != kSeparator) present[text[i]] = 1;
    }
    table.resize(present.size());
    for (size_t t = 0; t < present.size(); ++t) {
      table[t] = uint32_t(num_tokens);
      num_tokens += present[t];
    }
  } else {
    ids.reserve(n);
    for (token_t t : text) {
      if (t != kSeparator) ids.push_back(t);
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    num_tokens = ids.size();
  }
  out.resize(n);
#pragma omp parallel for num_threads(threads)
  for (size_t i = 0; i < n; ++i) {
    const token_t t = text[i];
    if (t == kSeparator) continue;
    out[i] = Symbol(table.empty() ? std::lower_bound(ids.begin(), ids.end(), t) - ids.begin() : table[t]);
  }
  // Separators in position order (a serial scan: they are few and sparse).
  int64_t next = int64_t(num_tokens);
  for (size_t i = 0; i < n; ++i) {
    if (text[i] == kSeparator) out[i] = Symbol(next++);
  }
  return std::max<int64_t>(next, 1);
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
  if (std::is_same_v<Index, uint32_t> && n <= size_t(std::numeric_limits<int32_t>::max())) {
    // 32-bit: the caller's array is libsais's output (no free space after
    // it, fs = 0). Peak extra memory: the 4-byte symbol copy of the stream.
    std::vector<int32_t> symbols;
    const int64_t k = integer_alphabet(text, symbols, threads);
    rc = sort32(symbols.data(), reinterpret_cast<int32_t*>(sa.data()), int32_t(n), int32_t(k), threads);
  } else {
    // 64-bit (or a 32-bit array past 2^31 tokens): libsais64 over 8-byte
    // symbols; a 32-bit result goes through an 8-byte buffer.
    std::vector<int64_t> symbols;
    const int64_t k = integer_alphabet(text, symbols, threads);
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
