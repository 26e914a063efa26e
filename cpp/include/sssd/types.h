// Basic types shared by every component of the SSSD core.
#pragma once

#include <cstdint>
#include <limits>

namespace sssd {

/// A token id. 32 bits wide so that vocabularies above 65,535 work.
using token_t = uint32_t;

/// Document separator in a datastore token stream. No continuation ever
/// crosses it, and it is never a valid token id: ids go up to 2^32 - 2.
inline constexpr token_t kSeparator = std::numeric_limits<token_t>::max();

/// Largest token id that may appear in a stream or a query.
inline constexpr token_t kMaxTokenId = kSeparator - 1;

/// Where a draft node came from (the `source` tag of a draft tree node).
/// Tags from kExternal up name the caller's sources (a model drafter, ...),
/// one tag each: kExternal, kExternal + 1, ...
enum class Source : uint8_t {
  kDatastore = 0,  ///< the offline suffix-array datastore
  kInput = 1,      ///< the request's own prompt + generated tokens
  kExternal = 2,   ///< the first tree supplied by the caller (e.g. a model drafter)
  kCopy = 15,      ///< the request's own text, a long repeat followed deep (copy_index.h)
};
/// Sources of a default score table (datastore, input, one external).
inline constexpr int kNumSources = 3;
/// Source tags are below this; external tags below kCopy (so at most 13 external sources).
inline constexpr int kMaxSources = 16;

}  // namespace sssd
