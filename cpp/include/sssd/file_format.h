// On-disk layout of a datastore's binary files (format version 1).
//
// A datastore directory holds three files, each a 64-byte header followed by
// a little-endian array:
//   tokens.bin        uint32 token ids, kSeparator between documents
//   suffix_array.bin  uint32 (streams under 2^32 - 1 tokens) or uint64
//                     suffix start positions, in suffix order
//   token_index.bin   uint64 first-token index: entry t is the rank of the
//                     first suffix starting with token t, for t in
//                     [0, vocab_size]; entry vocab_size is where the
//                     separator-initial suffixes begin. Searches start inside
//                     the first token's range. Empty (0 entries) when the ids
//                     are too sparse for a dense table.
// Every header carries the stream's length, vocabulary size, document count
// and a 64-bit fingerprint of the token stream, so files of different streams
// cannot be paired; suffix_array.bin's also says how its separators sort
// (suffix_order: one symbol, or by position in datastores written before). Loaders check magic, version, element width and file size
// before mapping anything.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "sssd/types.h"

namespace sssd {

inline constexpr uint32_t kFormatVersion = 1;
inline constexpr char kTokensMagic[8] = {'S', 'S', 'S', 'D', 'T', 'O', 'K', 'S'};
inline constexpr char kSuffixArrayMagic[8] = {'S', 'S', 'S', 'D', 'S', 'U', 'F', 'A'};
inline constexpr const char* kTokensFile = "tokens.bin";
inline constexpr const char* kSuffixArrayFile = "suffix_array.bin";
inline constexpr char kTokenIndexMagic[8] = {'S', 'S', 'S', 'D', 'T', 'I', 'D', 'X'};
inline constexpr const char* kTokenIndexFile = "token_index.bin";

/// The 64-byte header of both files.
struct FileHeader {
  char magic[8];         ///< kTokensMagic or kSuffixArrayMagic
  uint32_t version;      ///< kFormatVersion
  uint32_t elem_bytes;   ///< 4 (tokens; 32-bit suffix array) or 8 (64-bit suffix array)
  uint64_t count;        ///< elements in the array == tokens in the stream
  uint64_t vocab_size;   ///< 1 + largest token id in the stream (0 if none)
  uint64_t num_docs;     ///< documents: separators + 1 if the stream doesn't end with one (0 if empty)
  uint64_t fingerprint;  ///< stream_fingerprint() of the token stream
  uint8_t suffix_order;  ///< suffix_array.bin: how separators sort (kSuffixOrder*); 0 elsewhere
  uint8_t reserved[15];  ///< zero
};

/// Suffix arrays written before the separator became one symbol: suffixes
/// that reach a separator together are ordered by position.
inline constexpr uint8_t kSuffixOrderByPosition = 0;
/// The separator is one symbol above every token; suffixes compare on past it (suffix_sort.h).
inline constexpr uint8_t kSuffixOrderSeparatorSymbol = 1;
static_assert(sizeof(FileHeader) == 64);

/// Summary of a token stream, as stored in both headers.
struct StreamStats {
  uint64_t count = 0;
  uint64_t vocab_size = 0;
  uint64_t num_docs = 0;
  uint64_t fingerprint = 0;
};

/// Computes count, vocabulary size, document count and fingerprint in one
/// parallel pass. The fingerprint does not depend on the thread count.
StreamStats stream_stats(std::span<const token_t> tokens, int num_threads);

/// Reads and validates a header at the start of `bytes` of a file `what`.
/// Throws sssd::Error naming the file if it is too short, has the wrong magic,
/// a newer or unknown version, an unexpected element width, or a size that
/// does not match its element count.
FileHeader read_header(const uint8_t* bytes, size_t size, const char (&magic)[8],
                       const std::string& what);

/// The first-token index of a stream with `vocab_size` (see token_index.bin);
/// empty when vocab_size is too large for a dense table (> 4n + 2^24).
std::vector<uint64_t> first_token_index(std::span<const token_t> tokens, uint64_t vocab_size);

/// A filled-in header.
FileHeader make_header(const char (&magic)[8], uint32_t elem_bytes, const StreamStats& stats,
                       uint8_t suffix_order = 0);

}  // namespace sssd
