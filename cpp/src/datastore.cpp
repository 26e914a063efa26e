#include "sssd/datastore.h"

#include <cmath>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "sssd/check.h"
#include "sssd/coro.h"

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
  SSSD_CHECK_ARG(q.branch_per_match >= 0 && q.branch_per_match <= 255,
                 "branch_per_match must be in [0, 255], got ", q.branch_per_match);
  SSSD_CHECK_ARG(q.max_branch_len >= 1 && q.max_branch_len <= 255, "max_branch_len must be in [1, 255], got ",
                 q.max_branch_len);
  SSSD_CHECK_ARG(q.match_boost >= 1 && q.match_boost <= 16, "match_boost must be in [1, 16], got ",
                 q.match_boost);
  SSSD_CHECK_ARG(q.end_token >= -1 && q.end_token <= int64_t(kMaxTokenId),
                 "end_token must be -1 or a token id, got ", q.end_token);
}

Datastore::Datastore(Bytes tokens, Bytes suffixes, Bytes index, const std::string& where)
    : dir_(where),
      tokens_bytes_(std::move(tokens)),
      suffix_bytes_(std::move(suffixes)),
      token_index_bytes_(std::move(index)) {
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
  SSSD_CHECK(sh.suffix_order == kSuffixOrderByPosition || sh.suffix_order == kSuffixOrderSeparatorSymbol, sa_name,
             ": unknown suffix order ", int(sh.suffix_order), " (written by a newer sssd?); rebuild the datastore");
  suffix_order_ = sh.suffix_order;
  n_ = header_.count;
  index_bytes_ = int(sh.elem_bytes);
  SSSD_CHECK(index_bytes_ == 8 || fits_32bit_index(n_), sa_name,
             ": 32-bit suffix indices cannot address ", n_, " tokens");
  text_ = reinterpret_cast<const token_t*>(tokens_bytes_.data() + sizeof(FileHeader));
  sa_ = suffix_bytes_.data() + sizeof(FileHeader);

  const std::string idx_name = where + "/" + kTokenIndexFile;
  const FileHeader ih =
      read_header(token_index_bytes_.data(), token_index_bytes_.size(), kTokenIndexMagic, idx_name);
  SSSD_CHECK(ih.fingerprint == header_.fingerprint && ih.elem_bytes == 8, idx_name,
             " belongs to a different token stream than ", tok_name, "; rebuild the datastore");
  if (ih.count > 0) {
    SSSD_CHECK(ih.count == header_.vocab_size + 1, idx_name, ": ", ih.count,
               " entries, expected vocab_size + 1 = ", header_.vocab_size + 1);
    first_ = reinterpret_cast<const uint64_t*>(token_index_bytes_.data() + sizeof(FileHeader));
    SSSD_CHECK_AS(CorruptFile, first_[ih.count - 1] <= n_, idx_name,
                  ": corrupt: its last entry points beyond the stream; rebuild the datastore");
  }
}

std::pair<size_t, size_t> Datastore::first_token_range(token_t t) const {
  if (!first_) return {0, n_};
  if (t >= header_.vocab_size) {
    const size_t end = first_[header_.vocab_size];
    return {end, end};
  }
  size_t lo = first_[t], hi = first_[t + 1];
  SSSD_CHECK_AS(CorruptFile, lo <= hi && hi <= n_, "corrupt token index at token ", t, " (run `sssd verify`)");
  return {lo, hi};
}

std::shared_ptr<const Datastore> Datastore::open(const std::string& dir, bool validate, int num_threads) {
  Bytes tokens = Bytes::map_file(dir + "/" + kTokensFile, /*random_access=*/true);
  Bytes suffixes = Bytes::map_file(dir + "/" + kSuffixArrayFile, /*random_access=*/true);
  Bytes index = Bytes::map_file(dir + "/" + kTokenIndexFile, /*random_access=*/false);
  std::shared_ptr<const Datastore> ds(new Datastore(std::move(tokens), std::move(suffixes), std::move(index), dir));
  if (validate) ds->validate(num_threads);
  return ds;
}

std::shared_ptr<const Datastore> Datastore::from_tokens(std::span<const token_t> tokens,
                                                        int num_threads) {
  const StreamStats st = stream_stats(tokens, num_threads);
  Bytes tok = Bytes::own(with_header(make_header(kTokensMagic, 4, st), tokens));
  Bytes suf;
  if (fits_32bit_index(tokens.size())) {
    std::vector<uint32_t> sa(tokens.size());
    build_suffix_array<uint32_t>(tokens, sa, num_threads);
    suf = Bytes::own(with_header(make_header(kSuffixArrayMagic, 4, st, kSuffixOrderSeparatorSymbol),
                                 std::span<const uint32_t>(sa)));
  } else {
    std::vector<uint64_t> sa(tokens.size());
    build_suffix_array<uint64_t>(tokens, sa, num_threads);
    suf = Bytes::own(with_header(make_header(kSuffixArrayMagic, 8, st, kSuffixOrderSeparatorSymbol),
                                 std::span<const uint64_t>(sa)));
  }
  const std::vector<uint64_t> first = first_token_index(tokens, st.vocab_size);
  StreamStats ist = st;
  ist.count = first.size();
  Bytes idx = Bytes::own(with_header(make_header(kTokenIndexMagic, 8, ist), std::span<const uint64_t>(first)));
  return std::shared_ptr<const Datastore>(
      new Datastore(std::move(tok), std::move(suf), std::move(idx), "<memory>"));
}

void Datastore::write(std::span<const token_t> tokens, const std::string& dir, int num_threads,
                      const SortProgress& progress) {
  const StreamStats st = stream_stats(tokens, num_threads);
  write_file(dir + "/" + kTokensFile, make_header(kTokensMagic, 4, st), tokens.data(),
             tokens.size_bytes());
  if (fits_32bit_index(tokens.size())) {
    std::vector<uint32_t> sa(tokens.size());
    build_suffix_array<uint32_t>(tokens, sa, num_threads, progress);
    write_file(dir + "/" + kSuffixArrayFile, make_header(kSuffixArrayMagic, 4, st, kSuffixOrderSeparatorSymbol),
               sa.data(), sa.size() * 4);
  } else {
    std::vector<uint64_t> sa(tokens.size());
    build_suffix_array<uint64_t>(tokens, sa, num_threads, progress);
    write_file(dir + "/" + kSuffixArrayFile, make_header(kSuffixArrayMagic, 8, st, kSuffixOrderSeparatorSymbol),
               sa.data(), sa.size() * 8);
  }
  const std::vector<uint64_t> first = first_token_index(tokens, st.vocab_size);
  StreamStats ist = st;
  ist.count = first.size();
  write_file(dir + "/" + kTokenIndexFile, make_header(kTokenIndexMagic, 8, ist), first.data(),
             first.size() * 8);
}

size_t Datastore::warm() const {
  size_t bytes = 0;
  for (const Bytes* b : {&tokens_bytes_, &suffix_bytes_, &token_index_bytes_}) {
    b->populate();
    bytes += b->size();
  }
  return bytes;
}

size_t Datastore::lock() const {
  size_t bytes = 0;
  for (const auto& [b, name] : {std::pair{&tokens_bytes_, kTokensFile}, std::pair{&suffix_bytes_, kSuffixArrayFile},
                                std::pair{&token_index_bytes_, kTokenIndexFile}}) {
    b->lock(dir_ + "/" + name);
    bytes += b->size();
  }
  return bytes;
}

bool Datastore::page_out() const {
  bool ok = true;
  for (const Bytes* b : {&tokens_bytes_, &suffix_bytes_, &token_index_bytes_}) ok = b->page_out() && ok;
  return ok;
}

size_t Datastore::resident_bytes() const {
  size_t bytes = 0;
  for (const Bytes* b : {&tokens_bytes_, &suffix_bytes_, &token_index_bytes_}) bytes += b->resident_bytes();
  return bytes;
}

size_t Datastore::suffix(size_t r) const {
  SSSD_CHECK_AS(std::out_of_range, r < n_, "suffix rank ", r, " is out of range for a datastore of ", n_,
                " tokens");
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
  SSSD_CHECK_AS(CorruptFile, pos < n_, "corrupt suffix array: entry ", r, " points at ", pos, " beyond ", n_,
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
  auto lower = bound(first, last, pattern, offset, /*upper=*/false);
  const size_t lo = run(lower);
  auto upper = bound(lo, last, pattern, offset, /*upper=*/true);
  return {lo, run(upper)};
}

Datastore::Start Datastore::start(std::span<const token_t> pattern) const {
  if (!first_ || pattern.empty()) return {0, n_, 0};
  const auto [lo, hi] = first_token_range(pattern[0]);
  return {lo, hi, 1};
}

std::pair<size_t, size_t> Datastore::find(std::span<const token_t> pattern) const {
  const Start s = start(pattern);
  return find_in(s.lo, s.hi, pattern.subspan(s.offset), s.offset);
}

bool Datastore::occurs(std::span<const token_t> pattern) const {
  const auto [lo, hi] = find(pattern);
  return hi > lo;
}

Task<size_t> Datastore::bound(size_t lo, size_t hi, std::span<const token_t> rest, size_t offset,
                              bool upper) const {
  // First rank in [lo, hi) whose suffix, `offset` tokens in, is >= rest
  // (> rest if upper). Every probe is two dependent misses: the suffix-array
  // entry, then the text it points at.
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    co_await Prefetch{sa_ + mid * size_t(index_bytes_)};
    const size_t pos = suffix(mid) + offset;
    co_await Prefetch{text_ + std::min(pos, n_ - 1)};
    const int c = compare(pos, rest);
    if (upper ? c <= 0 : c < 0) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  co_return lo;
}

Task<Datastore::Bound> Datastore::at_least(std::span<const token_t> pattern, size_t need) const {
  // The lower bound, and whether `need` suffixes from it on start with pattern.
  const Start s = start(pattern);
  const auto rest = pattern.subspan(s.offset);
  Bound b;
  b.lower = co_await bound(s.lo, s.hi, rest, s.offset, /*upper=*/false);
  const size_t last = b.lower + need - 1;
  if (last < s.hi) {
    co_await Prefetch{sa_ + last * size_t(index_bytes_)};
    const size_t pos = suffix(last) + s.offset;
    co_await Prefetch{text_ + std::min(pos, n_ - 1)};
    b.enough = compare(pos, rest) == 0;
  }
  co_return b;
}

void Datastore::stage_continuation(size_t start, int branch_len, float weight,
                                   ContinuationTree& out) const {
  // A valid suffix array puts `start` at most at the stream's end; a corrupt
  // one can put it past it: that continuation is empty, as at the end.
  const size_t begin = std::min(start, n_);
  const size_t limit = std::min(n_, begin + size_t(branch_len));
  // Every id of a valid stream is below vocab_size or the separator (above
  // it): one comparison finds the separator, and an id that a corrupt
  // stream holds outside the vocabulary ends the continuation too.
  const uint64_t vocab = header_.vocab_size;
  size_t p = begin;
  while (p < limit && text_[p] < vocab) ++p;
  using End = ContinuationTree::End;
  const End end = p < limit ? (text_[p] == kSeparator ? End::kSeparator : End::kStream)  // stopped early
                  : p == begin + size_t(branch_len) ? End::kLength
                                                    : End::kStream;
  out.stage({text_ + begin, p - begin}, end, weight);
}

int Datastore::match_at(size_t pos, int len, int longest, std::span<const token_t> context) const {
  const size_t ctx_n = context.size();
  int match = len;
  while (match < longest && pos >= size_t(match - len + 1)) {
    const token_t t = text_[pos - size_t(match - len + 1)];
    if (t == kSeparator || t != context[ctx_n - size_t(match) - 1]) break;
    ++match;
  }
  return match;
}

Task<bool> Datastore::sample(size_t first, size_t last, int len, int longest, std::span<const token_t> context,
                             DatastoreQuery q, float weight, ContinuationTree* out) const {
  const size_t count = last - first;
  const size_t take = std::min<size_t>(count, q.max_samples);
  // Empty only if the ranges disagree with the binary search (a corrupt
  // suffix array): nothing to sample.
  if (take == 0) co_return false;
  // Regular intervals, centred in each of `take` equal slices of the range.
  const bool wide = count > (size_t(1) << 40);  // (2k + 1) * count could overflow 64 bits
  auto rank_of = [&](size_t k) {
    if (take == count) return first + k;
    return first + (wide ? size_t((unsigned __int128)(2 * k + 1) * count / (2 * take))
                         : (2 * k + 1) * count / (2 * take));
  };
  // Issue every suffix-array read, then every text read, before using any:
  // the misses overlap instead of queueing.
  for (size_t k = 0; k < take; ++k) __builtin_prefetch(sa_ + rank_of(k) * size_t(index_bytes_));
  co_await Prefetch{sa_ + rank_of(take - 1) * size_t(index_bytes_)};
  std::vector<size_t> start(take);
  for (size_t k = 0; k < take; ++k) {
    start[k] = suffix(rank_of(k)) + size_t(len);
    __builtin_prefetch(text_ + std::min(start[k], n_ - 1));
  }
  co_await Prefetch{text_ + std::min(start[take - 1], n_ - 1)};
  const bool adaptive = q.branch_per_match > 0;
  for (size_t k = 0; k < take; ++k) {
    const int match = adaptive ? match_at(start[k] - size_t(len), len, longest, context) : len;
    stage_continuation(start[k], q.branch_for(match), weight, *out);
  }
  out->end_run();
  co_return true;
}

// boost + boost^2 + ... + boost^levels: the weight of an occurrence that
// belongs to `levels` levels above the base.
static double boost_sum(double boost, int levels) {
  double w = 0, p = 1;
  for (int j = 0; j < levels; ++j) w += (p *= boost);
  return w;
}

Task<Datastore::Weighted> Datastore::stage_weighted(size_t first, size_t last, int len, int longest,
                                                    std::span<const token_t> context,
                                                    DatastoreQuery q, ContinuationTree* out) const {
  const size_t count = last - first;
  for (size_t k = 0; k < count; ++k) __builtin_prefetch(sa_ + (first + k) * size_t(index_bytes_));
  co_await Prefetch{sa_ + (last - 1) * size_t(index_bytes_)};
  std::vector<size_t> pos(count);
  for (size_t k = 0; k < count; ++k) {
    pos[k] = suffix(first + k);
    __builtin_prefetch(text_ + (pos[k] > 16 ? pos[k] - 16 : 0));
  }
  co_await Prefetch{text_ + (pos[count - 1] > 16 ? pos[count - 1] - 16 : 0)};
  Weighted w;
  w.match_len = len;
  for (size_t k = 0; k < count; ++k) {
    // How far back the context keeps matching before this occurrence.
    const int match = match_at(pos[k], len, longest, context);
    if (match > w.match_len) {
      w.match_len = match;
      w.occurrences = 0;
    }
    if (match == w.match_len) ++w.occurrences;
    w.samples += uint32_t(match - len + 1);
    // Levels len..match; level len + j weighs boost^(j + 1) samples of the
    // base level (len - 1), or boost^j without one (len is then the lowest).
    const int levels = match - len + 1;
    const float weight = q.match_boost == 1 ? float(levels)
                         : float(boost_sum(q.match_boost, levels) / (len - 1 >= q.min_match ? 1.0 : q.match_boost));
    stage_continuation(pos[k] + size_t(len), q.branch_for(match), weight, *out);
  }
  out->end_run();
  co_return w;
}

QueryStats Datastore::query_levels(std::span<const token_t> context, const DatastoreQuery& q,
                                   ContinuationTree& out) const {
  QueryStats stats;
  const int longest = int(std::min<size_t>(context.size(), size_t(q.max_match)));
  auto suffix_of = [&](int len) { return context.subspan(context.size() - size_t(len)); };
  int lo = q.min_match - 1, hi = longest;  // occurs at lo (or lo < min_match); search (lo, hi]
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (occurs(suffix_of(mid))) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  if (lo < q.min_match) return stats;
  stats.match_len = lo;
  // The levels used, longest first, down to the first with enough occurrences;
  // level len weighs match_boost^(len - lowest level used).
  struct Level {
    int len;
    size_t first, last;
  };
  std::vector<Level> levels;
  for (int len = lo; len >= q.min_match; --len) {
    const auto [first, last] = find(suffix_of(len));
    levels.push_back({len, first, last});
    if (last - first >= q.min_occurrences) break;
  }
  stats.occurrences = levels.front().last - levels.front().first;
  const int lowest = levels.back().len;
  for (const Level& l : levels) {
    auto t = sample(l.first, l.last, l.len, longest, context, q, float(std::pow(q.match_boost, l.len - lowest)), &out);
    run(t);
    stats.samples += uint32_t(std::min<size_t>(l.last - l.first, q.max_samples));
    ++stats.levels;
  }
  out.commit_runs(q.end_token);
  return stats;
}

QueryStats Datastore::query(std::span<const token_t> context, const DatastoreQuery& q,
                            ContinuationTree& out) const {
  auto task = query_task(context, q, &out);
  return run(task);
}

Task<QueryStats> Datastore::query_task(std::span<const token_t> context, DatastoreQuery q,
                                       ContinuationTree* out) const {
  out->clear();
  const int longest = int(std::min<size_t>(context.size(), size_t(q.max_match)));
  if (longest < q.min_match || n_ == 0) co_return QueryStats{};
  if (q.min_occurrences > q.max_samples) co_return query_levels(context, q, *out);
  auto suffix_of = [&](int len) { return context.subspan(context.size() - size_t(len)); };
  const size_t need = std::max<uint64_t>(q.min_occurrences, 1);

  // Base: the longest suffix occurring >= need times (counts fall with
  // length). Lower bounds are kept by length (kUnset until searched).
  constexpr size_t kUnset = ~size_t(0);
  std::vector<size_t> bound_of(size_t(longest) + 2, kUnset);
  int lo = q.min_match - 1, hi = longest;  // holds at lo (or lo < min_match); search (lo, hi]
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    const Bound b = co_await at_least(suffix_of(mid), need);
    bound_of[size_t(mid)] = b.lower;
    if (b.enough) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int base = lo;
  QueryStats stats;
  stats.match_len = base >= q.min_match ? base : 0;

  // Levels above the base: every occurrence of the base + 1 suffix (fewer
  // than `need` <= max_samples), weighted by the levels it belongs to.
  if (base + 1 <= longest) {
    const auto pattern = suffix_of(base + 1);
    const Start st = start(pattern);
    const auto rest = pattern.subspan(st.offset);
    size_t first = bound_of[size_t(base + 1)];
    if (first == kUnset) first = co_await bound(st.lo, st.hi, rest, st.offset, /*upper=*/false);
    // Fewer than `need` occurrences in a valid datastore (base + 1 is above
    // the base); the cap bounds the scan when a corrupt one disagrees.
    size_t last = first;
    while (last < st.hi && last - first < need) {
      co_await Prefetch{text_ + std::min(suffix(last) + st.offset, n_ - 1)};
      if (compare(suffix(last) + st.offset, rest) != 0) break;
      ++last;
    }
    if (last > first) {
      const Weighted w = co_await stage_weighted(first, last, base + 1, longest, context, q, out);
      stats.match_len = w.match_len;
      stats.occurrences = w.occurrences;
      stats.samples += w.samples;
    }
  }
  // The base level itself, sampled at regular intervals.
  if (base >= q.min_match) {
    const auto pattern = suffix_of(base);
    const Start st = start(pattern);
    const size_t first = bound_of[size_t(base)];
    const size_t last = co_await bound(first + need, st.hi, pattern.subspan(st.offset), st.offset, /*upper=*/true);
    co_await sample(first, last, base, longest, context, q, 1.0f, out);
    stats.samples += uint32_t(std::min<size_t>(last - first, q.max_samples));
    if (stats.match_len == base) stats.occurrences = last - first;
  }
  if (stats.match_len == 0) co_return QueryStats{};
  stats.levels = stats.match_len - std::max(base, q.min_match) + 1;
  out->commit_runs(q.end_token);
  co_return stats;
}

}  // namespace sssd
