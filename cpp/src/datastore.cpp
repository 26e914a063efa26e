#include "sssd/datastore.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "sssd/check.h"

namespace sssd {
namespace {

// Serialises header + array into one buffer (for in-memory datastores).
template <typename T>
std::vector<uint8_t> with_header(const FileHeader& h, std::span<const T> data) {
  std::vector<uint8_t> out(sizeof(FileHeader) + data.size_bytes());
  std::memcpy(out.data(), &h, sizeof(h));
  if (!data.empty()) std::memcpy(out.data() + sizeof(h), data.data(), data.size_bytes());
  return out;
}

void write_file(const std::string& path, const FileHeader& h, const void* data, size_t bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  SSSD_CHECK(f != nullptr, "cannot create ", path, ": ", std::strerror(errno));
  bool ok = std::fwrite(&h, sizeof(h), 1, f) == 1;
  // Write in 64 MiB pieces so a failure is reported near where it happened.
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t off = 0; ok && off < bytes; off += size_t(64) << 20) {
    const size_t len = std::min(bytes - off, size_t(64) << 20);
    ok = std::fwrite(p + off, 1, len, f) == len;
  }
  const int err = errno;
  ok = (std::fflush(f) == 0) && ok;
  ok = (std::fclose(f) == 0) && ok;
  SSSD_CHECK(ok, "cannot write ", path, ": ", std::strerror(err ? err : errno),
             " (is the disk full?)");
}

bool fits_32bit_index(size_t n) { return n < size_t(UINT32_MAX) - 1; }

}  // namespace

void check_query(const DatastoreQuery& q) {
  SSSD_CHECK_ARG(q.max_match >= 1 && q.max_match <= 1024, "max_match must be in [1, 1024], got ",
                 q.max_match);
  SSSD_CHECK_ARG(q.min_match >= 1 && q.min_match <= q.max_match,
                 "min_match must be in [1, max_match], got ", q.min_match);
  SSSD_CHECK_ARG(q.max_samples >= 1, "max_samples must be >= 1");
  SSSD_CHECK_ARG(q.branch_len >= 1 && q.branch_len <= 255, "branch_len must be in [1, 255], got ",
                 q.branch_len);
  SSSD_CHECK_ARG(q.end_token >= -1 && q.end_token <= int64_t(kMaxTokenId),
                 "end_token must be -1 or a token id, got ", q.end_token);
}

Datastore::Datastore(Bytes tokens, Bytes suffixes, const std::string& where)
    : tokens_bytes_(std::move(tokens)), suffix_bytes_(std::move(suffixes)) {
  const std::string tok_name = where + "/" + kTokensFile;
  const std::string sa_name = where + "/" + kSuffixArrayFile;
  header_ = read_header(tokens_bytes_.data(), tokens_bytes_.size(), kTokensMagic, tok_name);
  SSSD_CHECK(header_.elem_bytes == 4, tok_name, ": token width must be 4 bytes, got ",
             header_.elem_bytes);
  const FileHeader sh =
      read_header(suffix_bytes_.data(), suffix_bytes_.size(), kSuffixArrayMagic, sa_name);
  SSSD_CHECK(sh.count == header_.count && sh.fingerprint == header_.fingerprint, sa_name,
             " belongs to a different token stream than ", tok_name,
             " (length or fingerprint differ); rebuild the datastore");
  n_ = header_.count;
  index_bytes_ = int(sh.elem_bytes);
  SSSD_CHECK(index_bytes_ == 8 || fits_32bit_index(n_), sa_name,
             ": 32-bit suffix indices cannot address ", n_, " tokens");
  text_ = reinterpret_cast<const token_t*>(tokens_bytes_.data() + sizeof(FileHeader));
  sa_ = suffix_bytes_.data() + sizeof(FileHeader);
}

std::shared_ptr<const Datastore> Datastore::open(const std::string& dir) {
  Bytes tokens = Bytes::map_file(dir + "/" + kTokensFile, /*random_access=*/true);
  Bytes suffixes = Bytes::map_file(dir + "/" + kSuffixArrayFile, /*random_access=*/true);
  return std::shared_ptr<const Datastore>(new Datastore(std::move(tokens), std::move(suffixes), dir));
}

std::shared_ptr<const Datastore> Datastore::from_tokens(std::span<const token_t> tokens,
                                                        int num_threads) {
  const StreamStats st = stream_stats(tokens, num_threads);
  Bytes tok = Bytes::own(with_header(make_header(kTokensMagic, 4, st), tokens));
  Bytes suf;
  if (fits_32bit_index(tokens.size())) {
    std::vector<uint32_t> sa(tokens.size());
    build_suffix_array<uint32_t>(tokens, sa, num_threads);
    suf = Bytes::own(with_header(make_header(kSuffixArrayMagic, 4, st), std::span<const uint32_t>(sa)));
  } else {
    std::vector<uint64_t> sa(tokens.size());
    build_suffix_array<uint64_t>(tokens, sa, num_threads);
    suf = Bytes::own(with_header(make_header(kSuffixArrayMagic, 8, st), std::span<const uint64_t>(sa)));
  }
  return std::shared_ptr<const Datastore>(new Datastore(std::move(tok), std::move(suf), "<memory>"));
}

void Datastore::write(std::span<const token_t> tokens, const std::string& dir, int num_threads,
                      const SortProgress& progress) {
  const StreamStats st = stream_stats(tokens, num_threads);
  write_file(dir + "/" + kTokensFile, make_header(kTokensMagic, 4, st), tokens.data(),
             tokens.size_bytes());
  if (fits_32bit_index(tokens.size())) {
    std::vector<uint32_t> sa(tokens.size());
    build_suffix_array<uint32_t>(tokens, sa, num_threads, progress);
    write_file(dir + "/" + kSuffixArrayFile, make_header(kSuffixArrayMagic, 4, st), sa.data(),
               sa.size() * 4);
  } else {
    std::vector<uint64_t> sa(tokens.size());
    build_suffix_array<uint64_t>(tokens, sa, num_threads, progress);
    write_file(dir + "/" + kSuffixArrayFile, make_header(kSuffixArrayMagic, 8, st), sa.data(),
               sa.size() * 8);
  }
}

size_t Datastore::suffix(size_t r) const {
  size_t pos;
  if (index_bytes_ == 4) {
    uint32_t v;
    std::memcpy(&v, sa_ + r * 4, 4);
    pos = v;
  } else {
    uint64_t v;
    std::memcpy(&v, sa_ + r * 8, 8);
    pos = v;
  }
  SSSD_CHECK(pos < n_, "corrupt suffix array: entry ", r, " points at ", pos, " beyond ", n_,
             " tokens (run `sssd verify`)");
  return pos;
}

int Datastore::compare(size_t pos, std::span<const token_t> pattern) const {
  for (size_t k = 0; k < pattern.size(); ++k) {
    if (pos + k >= n_) return -1;  // the suffix ends first: it sorts lower
    const token_t t = text_[pos + k];
    if (t == kSeparator) return 1;  // separators sort above every token
    if (t != pattern[k]) return t < pattern[k] ? -1 : 1;
  }
  return 0;
}

std::pair<size_t, size_t> Datastore::find_in(size_t first, size_t last,
                                             std::span<const token_t> pattern, size_t offset) const {
  // Three phases (as in infini-gram): narrow both ends until one probe
  // matches, then finish the lower and upper bounds on either side of it.
  size_t lo = first, hi = last;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    const int c = compare(suffix(mid) + offset, pattern);
    if (c < 0) {
      lo = mid + 1;
    } else if (c > 0) {
      hi = mid;
    } else {
      size_t a = lo, b = mid;  // lower bound in [lo, mid]
      while (a < b) {
        const size_t m = a + (b - a) / 2;
        if (compare(suffix(m) + offset, pattern) < 0) {
          a = m + 1;
        } else {
          b = m;
        }
      }
      size_t c2 = mid + 1, d = hi;  // upper bound in [mid + 1, hi]
      while (c2 < d) {
        const size_t m = c2 + (d - c2) / 2;
        if (compare(suffix(m) + offset, pattern) <= 0) {
          c2 = m + 1;
        } else {
          d = m;
        }
      }
      return {a, c2};
    }
  }
  return {lo, lo};
}

bool Datastore::occurs(std::span<const token_t> pattern) const {
  size_t lo = 0, hi = n_;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    const int c = compare(suffix(mid), pattern);
    if (c == 0) return true;
    if (c < 0) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return false;
}

void Datastore::sample(size_t first, size_t last, int len, const DatastoreQuery& q,
                       ContinuationTree& out) const {
  const size_t count = last - first;
  const size_t take = std::min<size_t>(count, q.max_samples);
  // Regular intervals, centred in each of `take` equal slices of the range.
  auto rank_of = [&](size_t k) {
    return take == count ? first + k : first + size_t((unsigned __int128)(2 * k + 1) * count / (2 * take));
  };
  // Issue every suffix-array read, then every text read, before using any:
  // the misses overlap instead of queueing.
  for (size_t k = 0; k < take; ++k) __builtin_prefetch(sa_ + rank_of(k) * size_t(index_bytes_));
  size_t starts[512];
  std::vector<size_t> big;
  size_t* start = take <= 512 ? starts : (big.resize(take), big.data());
  for (size_t k = 0; k < take; ++k) {
    start[k] = suffix(rank_of(k)) + size_t(len);
    __builtin_prefetch(text_ + std::min(start[k], n_ - 1));
    __builtin_prefetch(text_ + std::min(start[k] + size_t(q.branch_len) - 1, n_ - 1));
  }
  token_t path[256];
  for (size_t k = 0; k < take; ++k) {
    size_t depth = 0;
    auto end = ContinuationTree::End::kStream;
    for (size_t p = start[k]; depth < size_t(q.branch_len); ++p) {
      if (p >= n_) break;
      if (text_[p] == kSeparator) {
        end = ContinuationTree::End::kSeparator;
        break;
      }
      path[depth++] = text_[p];
      if (depth == size_t(q.branch_len)) end = ContinuationTree::End::kLength;
    }
    out.stage({path, depth}, end);
  }
}

QueryStats Datastore::query(std::span<const token_t> context, const DatastoreQuery& q,
                            ContinuationTree& out, MatchCache* cache) const {
  out.clear();
  QueryStats stats;
  const int longest = int(std::min<size_t>(context.size(), size_t(q.max_match)));
  auto suffix_of = [&](int len) { return context.subspan(context.size() - size_t(len)); };
  constexpr std::pair<size_t, size_t> kUnknown{1, 0};
  std::pair<size_t, size_t> ranges[1025];  // by suffix length; max_match <= 1024
  std::fill(ranges, ranges + longest + 1, kUnknown);
  std::pair<size_t, size_t> parents[1025];  // cached ranges to narrow from (offset = len - k)
  std::fill(parents, parents + longest + 1, kUnknown);

  // What the previous query of this request tells us.
  int upper = longest;
  size_t grown = 0;
  const bool usable = cache && cache->context_len > 0 && cache->context_len <= context.size() &&
                      n_ > 0 && longest >= q.min_match;
  if (usable) {
    grown = context.size() - cache->context_len;
    for (size_t j = 0; j < cache->ranges.size(); ++j) {
      const int len = cache->match_len - int(j) + int(grown);
      if (len >= 1 && len <= longest) {
        (grown == 0 ? ranges : parents)[len] = cache->ranges[j];
      }
    }
    // The longest match grows by at most the tokens appended.
    upper = std::min(longest, cache->match_len + int(grown));
  }
  auto range_of = [&](int len) {
    auto& r = ranges[len];
    if (r.first > r.second) {
      const auto& p = parents[len];
      r = p.first <= p.second && len > int(grown)
              ? find_in(p.first, p.second, suffix_of(int(grown)), size_t(len) - grown)
              : find(suffix_of(len));
    }
    return r;
  };
  auto occurs_len = [&](int len) {
    const auto& r = ranges[len];
    if (r.first <= r.second) return r.second > r.first;
    if (parents[len].first <= parents[len].second) return range_of(len).second > range_of(len).first;
    return occurs(suffix_of(len));
  };

  // Longest suffix that occurs at all: occurrence falls as the suffix grows.
  // With a cache, try the extension of the old match first (usually a hit).
  int lo = q.min_match - 1, hi = upper;  // occurs at lo (or lo < min_match); search (lo, hi]
  if (usable && upper >= q.min_match) {
    if (occurs_len(upper)) {
      lo = upper;
    } else {
      hi = upper - 1;
    }
  }
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (occurs_len(mid)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  if (cache) {
    // Remembered even without a match: the bound "longest <= lo + growth" holds.
    cache->clear();
    cache->context_len = context.size();
    cache->match_len = std::max(lo, 0);
  }
  if (lo < q.min_match || n_ == 0) return stats;
  stats.match_len = lo;
  stats.occurrences = range_of(lo).second - range_of(lo).first;

  // Backoff: each level's samples are one sorted run, summed into the tree.
  // Consecutive levels with equal counts have the same occurrences (each
  // occurrence of the longer suffix holds one of the shorter), hence the same
  // samples: they are read once, with the run's weight raised instead.
  int run_len = 0;
  size_t run_count = 0;
  float run_weight = 0;
  for (int len = lo; len >= q.min_match; --len) {
    const auto [first, last] = range_of(len);
    const size_t count = last - first;
    if (run_weight > 0 && count == run_count) {
      run_weight += 1.0f;
    } else {
      if (run_weight > 0) {
        sample(range_of(run_len).first, range_of(run_len).second, run_len, q, out);
        out.end_run(run_weight);
      }
      run_len = len;
      run_count = count;
      run_weight = 1.0f;
    }
    stats.samples += uint32_t(std::min<size_t>(count, q.max_samples));
    ++stats.levels;
    if (cache) cache->ranges.push_back({first, last});
    if (count >= q.min_occurrences) break;
  }
  sample(range_of(run_len).first, range_of(run_len).second, run_len, q, out);
  out.end_run(run_weight);
  out.commit_runs(q.end_token);
  return stats;
}

}  // namespace sssd
