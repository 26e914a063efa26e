#include "sssd/file_format.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "sssd/check.h"
#include "sssd/parallel.h"

namespace sssd {
namespace {

constexpr size_t kFingerprintChunk = size_t(1) << 20;

inline uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

StreamStats stream_stats(std::span<const token_t> tokens, int num_threads) {
  StreamStats st;
  st.count = tokens.size();
  const size_t chunks = (tokens.size() + kFingerprintChunk - 1) / kFingerprintChunk;
  std::vector<uint64_t> chunk_hash(chunks);
  std::vector<uint64_t> chunk_max(chunks, 0), chunk_seps(chunks, 0);
  std::vector<uint8_t> chunk_has_token(chunks, 0);
  parallel_for(chunks, resolve_threads(num_threads), [&](size_t c) {
    const size_t begin = c * kFingerprintChunk;
    const size_t end = std::min(tokens.size(), begin + kFingerprintChunk);
    uint64_t h = 0xcbf29ce484222325ULL, mx = 0, seps = 0;
    bool any = false;
    for (size_t i = begin; i < end; ++i) {
      const token_t t = tokens[i];
      h = (h ^ t) * 0x100000001b3ULL;
      if (t == kSeparator) {
        ++seps;
      } else {
        any = true;
        mx = std::max<uint64_t>(mx, t);
      }
    }
    chunk_hash[c] = mix64(h ^ (end - begin));
    chunk_max[c] = mx;
    chunk_seps[c] = seps;
    chunk_has_token[c] = any;
  });
  uint64_t h = mix64(tokens.size());
  bool any = false;
  for (size_t c = 0; c < chunks; ++c) {
    h = mix64(h ^ chunk_hash[c]);
    if (chunk_has_token[c]) st.vocab_size = std::max(st.vocab_size, chunk_max[c] + 1);
    any = any || chunk_has_token[c];
    st.num_docs += chunk_seps[c];
  }
  if (!tokens.empty() && tokens.back() != kSeparator) ++st.num_docs;
  st.fingerprint = h;
  return st;
}

std::vector<uint64_t> first_token_index(std::span<const token_t> tokens, uint64_t vocab_size) {
  if (vocab_size > 4 * uint64_t(tokens.size()) + (uint64_t(1) << 24)) return {};
  std::vector<uint64_t> index(size_t(vocab_size) + 1, 0);
  for (const token_t t : tokens) {
    if (t != kSeparator) ++index[t + 1];
  }
  for (size_t t = 1; t < index.size(); ++t) index[t] += index[t - 1];
  return index;
}

FileHeader make_header(const char (&magic)[8], uint32_t elem_bytes, const StreamStats& stats,
                       uint8_t suffix_order) {
  FileHeader h{};
  h.suffix_order = suffix_order;
  std::memcpy(h.magic, magic, 8);
  h.version = kFormatVersion;
  h.elem_bytes = elem_bytes;
  h.count = stats.count;
  h.vocab_size = stats.vocab_size;
  h.num_docs = stats.num_docs;
  h.fingerprint = stats.fingerprint;
  return h;
}

FileHeader read_header(const uint8_t* bytes, size_t size, const char (&magic)[8],
                       const std::string& what) {
  SSSD_CHECK(size >= sizeof(FileHeader), what, ": file is truncated (", size,
             " bytes, smaller than its 64-byte header)");
  FileHeader h;
  std::memcpy(&h, bytes, sizeof(h));
  SSSD_CHECK(std::memcmp(h.magic, magic, 8) == 0, what, ": not an SSSD ",
             std::string(magic, 8), " file (bad magic number)");
  SSSD_CHECK(h.version <= kFormatVersion, what, ": format version ", h.version,
             " is newer than this sssd supports (", kFormatVersion, "); upgrade sssd");
  SSSD_CHECK(h.version >= 1, what, ": invalid format version ", h.version);
  SSSD_CHECK(h.elem_bytes == 4 || h.elem_bytes == 8, what, ": invalid element width ", h.elem_bytes);
  SSSD_CHECK(h.count <= (size - sizeof(FileHeader)) / h.elem_bytes &&
                 sizeof(FileHeader) + h.count * h.elem_bytes == size,
             what, ": size ", size, " bytes does not match its header (", h.count, " elements of ",
             h.elem_bytes, " bytes + 64); the file is truncated or corrupt");
  return h;
}

}  // namespace sssd
