#include "sssd/suffix_sort.h"

#include <algorithm>
#include <bit>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "sssd/check.h"
#include "sssd/parallel.h"

namespace sssd {
namespace {

// [lo, hi): a run of suffixes in `sa` that are still tied (hi - lo >= 2).
template <typename Index>
struct Group {
  Index lo, hi;
};

// Maps token ids to dense symbols 1..K in id order (kSeparator largest), so
// that 0 can stand for "past the end of the stream". Returns K.
uint32_t dense_symbols(std::span<const token_t> text, std::vector<uint32_t>& out, int threads) {
  const size_t n = text.size();
  token_t max_id = 0;
#pragma omp parallel for reduction(max : max_id) num_threads(threads)
  for (size_t i = 0; i < n; ++i) {
    if (text[i] != kSeparator && text[i] > max_id) max_id = text[i];
  }
  out.resize(n);
  if (size_t(max_id) <= 4 * n + (size_t(1) << 20)) {
    // Direct table over the id range (slot max_id + 1 stands for kSeparator).
    std::vector<uint8_t> present(size_t(max_id) + 2, 0);
    for (size_t i = 0; i < n; ++i) present[text[i] == kSeparator ? size_t(max_id) + 1 : text[i]] = 1;
    std::vector<uint32_t> symbol(present.size());
    uint32_t next = 0;
    for (size_t t = 0; t < present.size(); ++t) {
      next += present[t];
      symbol[t] = next;
    }
#pragma omp parallel for num_threads(threads)
    for (size_t i = 0; i < n; ++i) out[i] = symbol[text[i] == kSeparator ? size_t(max_id) + 1 : text[i]];
    return next;
  }
  // Sparse ids: sort the distinct ids and binary-search each token.
  std::vector<token_t> ids(text.begin(), text.end());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
#pragma omp parallel for num_threads(threads)
  for (size_t i = 0; i < n; ++i) {
    out[i] = uint32_t(std::lower_bound(ids.begin(), ids.end(), text[i]) - ids.begin()) + 1;
  }
  return uint32_t(ids.size());
}

// Sorts (key, value) pairs by key; among equal keys, by value if
// `by_value_too`, else in no particular order. Small runs use std::sort;
// large ones an LSD radix sort over the key bits that differ (comparison
// sorts mispredict on nearly every compare here and were 3x slower).
template <typename Key, typename Value>
void sort_pairs(std::vector<std::pair<Key, Value>>& v, std::vector<std::pair<Key, Value>>& tmp,
                bool by_value_too) {
  constexpr size_t kRadixMin = 512;
  if (v.size() < kRadixMin) {
    if (by_value_too) {
      std::sort(v.begin(), v.end());
    } else {
      std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    }
    return;
  }
  // LSD radix is stable, so equal keys keep their input order; callers that
  // need ties by value hand the pairs in value order.
  Key diff = 0;
  for (const auto& p : v) diff |= p.first ^ v[0].first;
  const int top = std::bit_width(static_cast<std::make_unsigned_t<Key>>(diff));
  tmp.resize(v.size());
  size_t count[256];
  for (int shift = 0; shift < top; shift += 8) {
    std::fill(count, count + 256, 0);
    for (const auto& p : v) ++count[(p.first >> shift) & 0xFF];
    size_t total = 0;
    for (size_t& c : count) {
      const size_t k = c;
      c = total;
      total += k;
    }
    for (const auto& p : v) tmp[count[(p.first >> shift) & 0xFF]++] = p;
    v.swap(tmp);
  }
}

}  // namespace

template <typename Index>
void build_suffix_array(std::span<const token_t> text, std::span<Index> sa, int num_threads,
                        const SortProgress& progress) {
  const size_t n = text.size();
  SSSD_CHECK_ARG(sa.size() == n, "suffix array size ", sa.size(), " != text size ", n);
  SSSD_CHECK_ARG(n < size_t(std::numeric_limits<Index>::max()) - 1, "stream of ", n,
                 " tokens is too long for ", sizeof(Index) * 8, "-bit suffix indices");
  if (n == 0) return;
  const int T = resolve_threads(num_threads);

  // Separators are distinct symbols, ordered by position and above every
  // token: a suffix's order is decided by the time its first separator is
  // reached. So suffixes whose compared prefix holds a separator are final,
  // and the longest tie is bounded by the longest document.
  std::vector<uint32_t> sym;
  const uint32_t alphabet = dense_symbols(text, sym, T);
  const bool has_sep = std::find(text.begin(), text.end(), kSeparator) != text.end();
  const uint32_t sep_sym = has_sep ? alphabet : 0;  // 0: matches no symbol at a real position
  const int bits = std::bit_width(alphabet);        // symbols are 0..alphabet
  const uint64_t slot_mask = (uint64_t(1) << bits) - 1;
  const int per_key = 1 + 64 / bits;  // first token + tokens packed in a key

  // 1a. Counting sort on the first token (stable: per-thread offsets).
  std::vector<size_t> bucket(size_t(alphabet) + 2, 0);
  {
    std::vector<std::vector<size_t>> counts(T, std::vector<size_t>(size_t(alphabet) + 1, 0));
#pragma omp parallel num_threads(T)
    {
#ifdef _OPENMP
      const int t = omp_get_thread_num();
      const int nt = omp_get_num_threads();
#else
      const int t = 0, nt = 1;
#endif
      const size_t begin = n * t / nt, end = n * (t + 1) / nt;
      std::vector<size_t>& c = counts[t];
      for (size_t i = begin; i < end; ++i) ++c[sym[i]];
#pragma omp barrier
#pragma omp single
      {
        size_t total = 0;
        for (size_t s = 0; s <= alphabet; ++s) {
          bucket[s] = total;
          for (int u = 0; u < nt; ++u) {
            const size_t k = counts[u][s];
            counts[u][s] = total;
            total += k;
          }
        }
        bucket[size_t(alphabet) + 1] = total;
      }
      for (size_t i = begin; i < end; ++i) sa[c[sym[i]]++] = Index(i);
    }
  }

  // 1b. Within each first-token bucket, sort by the next per_key - 1 tokens
  // packed into a 64-bit key (stopping after a separator; ties by position).
  // rank[i] = start in sa of the group of suffixes that share suffix i's
  // first h tokens; final suffixes get their own position as rank.
  // Regions that allocate run their bodies under an ExceptionCapture: an
  // exception (std::bad_alloc) must not escape an OpenMP region, where it
  // would call std::terminate; it is rethrown after the region instead.
  std::vector<Index> rank(n);
  std::vector<Group<Index>> groups;
  ExceptionCapture capture;
#pragma omp parallel num_threads(T)
  {
    std::vector<std::pair<uint64_t, Index>> recs, tmp;
    std::vector<Group<Index>> found;
#pragma omp for schedule(dynamic, 16) nowait
    for (size_t s = 1; s <= alphabet; ++s) {
      capture.run([&] {
        const size_t lo = bucket[s], hi = bucket[s + 1];
        if (hi - lo == 1 || s == sep_sym) {
          for (size_t u = lo; u < hi; ++u) rank[sa[u]] = Index(u);
          return;
        }
        recs.clear();
        for (size_t u = lo; u < hi; ++u) {
          const size_t i = sa[u];
          uint64_t k = 0;
          bool stop = false;
          for (int j = 1; j < per_key; ++j) {
            const uint32_t c = (stop || i + j >= n) ? 0u : sym[i + j];
            stop = stop || c == sep_sym;
            k = (k << bits) | c;
          }
          recs.emplace_back(k, Index(i));
        }
        sort_pairs(recs, tmp, /*by_value_too=*/true);  // members arrive in position order
        for (size_t start = 0, u = 1; u <= recs.size(); ++u) {
          if (u < recs.size() && recs[u].first == recs[start].first) continue;
          bool final_group = u - start == 1;
          uint64_t k = recs[start].first;
          for (int j = 1; j < per_key && !final_group; ++j, k >>= bits) {
            final_group = (k & slot_mask) == sep_sym && sep_sym != 0;
          }
          for (size_t v = start; v < u; ++v) {
            sa[lo + v] = recs[v].second;
            rank[recs[v].second] = Index(final_group ? lo + v : lo + start);
          }
          if (!final_group) found.push_back({Index(lo + start), Index(lo + u)});
          start = u;
        }
      });
    }
#pragma omp critical
    capture.run([&] { groups.insert(groups.end(), found.begin(), found.end()); });
  }
  capture.rethrow();
  sym.clear();
  sym.shrink_to_fit();

  // 2. Prefix doubling over tied groups: after the round with offset h,
  // groups share their first 2h tokens. Ranks of other groups may already be
  // finer than h tokens; that only refines the order (Larsson & Sadakane).
  std::vector<Index> next_key(n);
  size_t h = size_t(per_key);
  while (!groups.empty()) {
    if (progress) {
      size_t tied = 0;
      for (const auto& g : groups) tied += g.hi - g.lo;
      progress(n - tied, n);
    }
    // Phase A: every tied suffix reads the rank h tokens further on
    // (0 = past the end, which sorts first). No rank is written here.
#pragma omp parallel for schedule(dynamic, 256) num_threads(T)
    for (size_t g = 0; g < groups.size(); ++g) {
      for (Index j = groups[g].lo; j < groups[g].hi; ++j) {
        const size_t p = size_t(sa[j]) + h;
        next_key[j] = p < n ? rank[p] + 1 : 0;
      }
    }
    // Phase B: sort each group by that key, split it, and rank the new
    // subgroups. A group writes only its own members' ranks, and only those
    // that change: the first subgroup keeps rank lo, and a group that does
    // not split (long repeats) costs one scan.
    std::vector<Group<Index>> next_groups;
#pragma omp parallel num_threads(T)
    {
      std::vector<std::pair<Index, Index>> pairs, tmp;
      std::vector<Group<Index>> found;
#pragma omp for schedule(dynamic, 64) nowait
      for (size_t g = 0; g < groups.size(); ++g) {
        capture.run([&] {
          const Index lo = groups[g].lo, hi = groups[g].hi;
          const Index first = next_key[lo];
          if (std::all_of(&next_key[lo] + 1, &next_key[0] + hi, [&](Index k) { return k == first; })) {
            found.push_back(groups[g]);
            return;
          }
          pairs.clear();
          for (Index j = lo; j < hi; ++j) pairs.emplace_back(next_key[j], sa[j]);
          sort_pairs(pairs, tmp, /*by_value_too=*/false);
          Index start = 0;
          for (Index u = 0; u < hi - lo; ++u) {
            sa[lo + u] = pairs[u].second;
            if (u > 0 && pairs[u].first != pairs[u - 1].first) {
              if (u - start >= 2) found.push_back({Index(lo + start), Index(lo + u)});
              start = u;
            }
            if (start > 0) rank[pairs[u].second] = lo + start;
          }
          if (hi - lo - start >= 2) found.push_back({Index(lo + start), hi});
        });
      }
#pragma omp critical
      capture.run([&] { next_groups.insert(next_groups.end(), found.begin(), found.end()); });
    }
    capture.rethrow();
    groups.swap(next_groups);
    // Distinct suffixes differ within n tokens, so this cannot loop forever.
    SSSD_CHECK(h <= 2 * n + 2, "suffix sort did not converge (internal error)");
    h *= 2;
  }
  if (progress) progress(n, n);
}

template void build_suffix_array<uint32_t>(std::span<const token_t>, std::span<uint32_t>, int,
                                           const SortProgress&);
template void build_suffix_array<uint64_t>(std::span<const token_t>, std::span<uint64_t>, int,
                                           const SortProgress&);

}  // namespace sssd
