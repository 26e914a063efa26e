// Suffix-array construction for token streams, by induced sorting (SA-IS)
// with libsais (third_party/libsais): cache-aware, prefetching and parallel
// with OpenMP, in linear time whatever the repeats.
//
// The stream is rewritten as a dense alphabet first: token ids as symbols in
// id order, and the separator (kSeparator) as one symbol above every token;
// suffixes that share a separator go on comparing past it, and the end of the
// stream sorts below everything. The result is the exact suffix array of that
// order. (Queries never cross a separator, so where two suffixes meet one
// their order changes no continuation.) With at most 2^16 symbols (a
// vocabulary below 65,535 ids) the 16-bit sort runs, else the integer one.
//
// Measured on the 27.5M-token ShareGPT stream: benchmarks/RESULTS.md, "The
// suffix sort".
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

#include "sssd/types.h"

namespace sssd {

/// Progress callback: called with (suffixes finalised, total) from the
/// calling thread between rounds. May be empty.
using SortProgress = std::function<void(size_t done, size_t total)>;

/// Writes the suffix array of `text` into `sa` (sa.size() == text.size()).
///
/// Index is uint32_t (text.size() <= 2^32 - 2) or uint64_t. Uses
/// `num_threads` OpenMP threads (0 = OpenMP's default). Peak extra memory
/// beyond `text` and `sa`: for a 32-bit index under 2^31 tokens 2 bytes per
/// token (at most 2^16 symbols) or 4; else 8 (16 for a 32-bit index past
/// 2^31 tokens). Throws
/// std::invalid_argument on a size mismatch or a stream too long for Index,
/// std::bad_alloc when memory runs out. `progress` is called at the start
/// and at the end (the sort has no rounds to report).
template <typename Index>
void build_suffix_array(std::span<const token_t> text, std::span<Index> sa,
                        int num_threads = 0, const SortProgress& progress = {});

extern template void build_suffix_array<uint32_t>(std::span<const token_t>, std::span<uint32_t>,
                                                  int, const SortProgress&);
extern template void build_suffix_array<uint64_t>(std::span<const token_t>, std::span<uint64_t>,
                                                  int, const SortProgress&);

}  // namespace sssd
