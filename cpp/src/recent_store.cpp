#include "sssd/recent_store.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <new>

#include "sssd/check.h"
#include "sssd/drafter.h"

namespace sssd {

static_assert(RecentStore::kMaxDepth == kMaxBudget, "a path as deep as the largest budget");

namespace {

template <typename T>
T* zeroed(uint64_t n) {
  void* p = std::calloc(size_t(n), sizeof(T));
  if (!p) throw std::bad_alloc();
  return static_cast<T*>(p);
}

// One occurrence's place in the trie being built at one depth.
struct Step {
  int32_t parent;  // local node at the previous depth (-1: the root)
  token_t token;
  size_t occurrence;
};

// Past a path's end (never a token id: kSeparator).
constexpr token_t kNone = kSeparator;

}  // namespace

RecentStore::RecentStore(int64_t capacity, int64_t max_match, int64_t min_match, int64_t max_matches, int64_t depth,
                         int64_t max_chain, double depth_per_match, double match_damping) {
  SSSD_CHECK_ARG(capacity >= 2, "capacity must be >= 2 tokens, got ", capacity);
  SSSD_CHECK_ARG(capacity <= (int64_t(1) << 40), "capacity must be <= 2^40 tokens, got ", capacity);
  SSSD_CHECK_ARG(2 <= min_match && min_match <= max_match, "need 2 <= min_match <= max_match, got ", min_match,
                 " and ", max_match);
  SSSD_CHECK_ARG(max_match <= (int64_t(1) << 20), "max_match must be <= 2^20, got ", max_match);
  SSSD_CHECK_ARG(max_matches >= 1 && depth >= 1 && max_chain >= 1, "max_matches, depth and max_chain must be >= 1");
  SSSD_CHECK_ARG(depth <= kMaxDepth, "depth must be <= ", kMaxDepth, ", got ", depth);
  SSSD_CHECK_ARG(depth_per_match >= 0, "depth_per_match must be >= 0, got ", depth_per_match);
  SSSD_CHECK_ARG(match_damping >= 0 && match_damping <= 1, "match_damping must be in [0, 1], got ", match_damping);
  capacity_ = uint64_t(capacity);
  buckets_ = std::bit_ceil(std::max<uint64_t>(2, capacity_));  // 1 << max(1, (n - 1).bit_length())
  max_match_ = max_match;
  min_match_ = min_match;
  max_matches_ = max_matches;
  depth_ = depth;
  max_chain_ = max_chain;
  depth_per_match_ = depth_per_match;
  match_damping_ = match_damping;
  slots_.reset(zeroed<Slot>(capacity_));
  head_.reset(zeroed<uint64_t>(buckets_));
}

uint64_t RecentStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::min(written_ - floor_, capacity_);
}

uint64_t RecentStore::written() const {
  std::lock_guard<std::mutex> lock(mu_);
  return written_;
}

void RecentStore::open(uint64_t request_id, std::span<const token_t> prompt) {
  const size_t keep = std::min(prompt.size(), size_t(max_match_));
  std::lock_guard<std::mutex> lock(mu_);
  last_.erase(request_id);
  append(request_id, prompt.subspan(prompt.size() - keep));
}

void RecentStore::extend(uint64_t request_id, std::span<const token_t> tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  append(request_id, tokens);
}

void RecentStore::extend_batch(std::span<const uint64_t> ids, std::span<const int64_t> offsets,
                               std::span<const token_t> tokens) {
  check_offsets(offsets, ids.size(), tokens.size());
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t b = 0; b < ids.size(); ++b) {
    append(ids[b], tokens.subspan(size_t(offsets[b]), size_t(offsets[b + 1] - offsets[b])));
  }
}

void RecentStore::close(uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  last_.erase(request_id);
}

void RecentStore::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  floor_ = written_;
  last_.clear();
}

void RecentStore::append(uint64_t request_id, std::span<const token_t> tokens) {
  if (tokens.empty()) return;
  const uint64_t mask = buckets_ - 1;
  const auto it = last_.find(request_id);
  uint64_t last = it == last_.end() ? 0 : it->second;
  for (const token_t t : tokens) {
    // The reference's order of writes, kept exactly: when the request's previous token is the
    // one this write overwrites (capacity writes ago), it links to itself, as there.
    const uint64_t a = written_;
    Slot& s = slots_[a % capacity_];
    s.token = t;
    s.owner = request_id;
    s.next = 0;
    if (alive(last)) {
      Slot& p = at(last);
      s.prev = last;
      p.next = a + 1;
      const uint64_t h = hash(p.token, t) & mask;
      s.chain = head_[h];
      head_[h] = a + 1;
    } else {
      s.prev = s.chain = 0;
    }
    written_ = a + 1;
    last = a + 1;
  }
  last_[request_id] = last;
}

std::vector<token_t> RecentStore::history(uint64_t request_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<token_t> out;
  const auto it = last_.find(request_id);
  // prev links go strictly back in time: the walk ends.
  for (uint64_t link = it == last_.end() ? 0 : it->second; alive(link); link = at(link).prev) {
    out.push_back(at(link).token);
  }
  std::reverse(out.begin(), out.end());
  return out;
}

RecentDrafts RecentStore::propose(std::span<const uint64_t> ids, std::span<const int64_t> queries,
                                  std::span<const int64_t> budgets) const {
  const size_t R = ids.size(), K = size_t(max_match_);
  SSSD_CHECK_ARG(budgets.size() == R, "budgets: expected ", R, " (one per request), got ", budgets.size());
  SSSD_CHECK_ARG(queries.size() == R * K, "queries: expected ", R, " x ", K, " tokens, got ", queries.size());
  for (size_t r = 0; r < R; ++r) SSSD_CHECK_ARG(budgets[r] >= 0, "budgets[", r, "] = ", budgets[r], " is negative");
  for (size_t i = 0; i < queries.size(); ++i) {
    SSSD_CHECK_ARG(queries[i] >= -1 && queries[i] <= int64_t(kMaxTokenId), "queries[", i / K, ", ", i % K,
                   "] = ", queries[i], " is not a token id (or -1: before the context's start)");
  }
  const auto query = [&](size_t r) { return queries.data() + r * K; };
  RecentDrafts out;
  out.offsets.assign(R + 1, 0);
  std::lock_guard<std::mutex> lock(mu_);

  // Every phase walks linked positions of all requests in lockstep, prefetching each one's next
  // position before reading the others' (the store is larger than the caches, its chains random):
  // the misses overlap instead of queueing.
  // 1. The chain of each context's last two tokens, newest first.
  std::vector<std::vector<uint64_t>> starts(R);
  std::vector<uint64_t> cur(R, 0);
  std::vector<uint32_t> walking;
  for (size_t r = 0; r < R; ++r) {
    if (written_ == floor_ || query(r)[0] < 0 || query(r)[1] < 0 || budgets[r] <= 0) continue;
    cur[r] = hash(uint64_t(query(r)[1]), uint64_t(query(r)[0])) & (buckets_ - 1);  // the bucket, for now
    __builtin_prefetch(&head_[cur[r]]);
    walking.push_back(uint32_t(r));
  }
  for (const uint32_t r : walking) prefetch(cur[r] = head_[cur[r]]);
  for (int64_t step = 0; step < max_chain_ && !walking.empty(); ++step) {
    size_t kept = 0;
    for (const uint32_t r : walking) {
      if (!alive(cur[r])) continue;
      starts[r].push_back(cur[r]);
      prefetch(cur[r] = at(cur[r]).chain);
      walking[kept++] = r;
    }
    walking.resize(kept);
  }
  // 2. Each eligible occurrence's match, measured backwards through its request's own tokens.
  struct Match {
    size_t r, index;  // the request, the occurrence's place in its chain
    uint64_t at;      // the position compared next
  };
  std::vector<std::vector<int64_t>> length(R);
  std::vector<Match> matching;
  for (size_t r = 0; r < R; ++r) {
    length[r].assign(starts[r].size(), -1);  // -1: not eligible
    for (size_t i = 0; i < starts[r].size(); ++i) {
      const Slot& s = at(starts[r][i]);
      if (s.owner == ids[r] || s.next == 0) continue;
      length[r][i] = 0;
      matching.push_back({r, i, starts[r][i]});
    }
  }
  for (size_t j = 0; j < K && !matching.empty(); ++j) {
    size_t kept = 0;
    for (Match m : matching) {
      if (!alive(m.at) || int64_t(at(m.at).token) != query(m.r)[j]) continue;
      ++length[m.r][m.index];
      prefetch(m.at = at(m.at).prev);
      matching[kept++] = m;
    }
    matching.resize(kept);
  }
  // 3. The longest eligible matches (the first max_matches, newest first), and how far to follow
  // them: int(best * depth_per_match) clipped to [kMinDepth, depth] (depth wins below kMinDepth,
  // as np.clip does), within the budget.
  struct Follow {
    size_t r;
    uint64_t at;  // the position read next (0: the path ended)
  };
  std::vector<Follow> follows;
  std::vector<size_t> first(R + 1, 0);  // request r's occurrences: follows[first[r]:first[r + 1]]
  std::vector<int64_t> best(R, 0), reach(R, 0);
  int64_t deepest = 0;
  for (size_t r = 0; r < R; ++r) {
    first[r] = follows.size();
    for (const int64_t l : length[r]) {
      if (l >= min_match_) best[r] = std::max(best[r], l);
    }
    if (best[r] == 0) continue;
    for (size_t i = 0; i < starts[r].size() && int64_t(follows.size() - first[r]) < max_matches_; ++i) {
      if (length[r][i] == best[r]) follows.push_back({r, at(starts[r][i]).next});
    }
    const double scaled = double(best[r]) * depth_per_match_;
    const int64_t deep = scaled >= double(depth_) ? depth_ : int64_t(scaled);
    reach[r] = std::min(budgets[r], std::min(std::max(deep, kMinDepth), depth_));
    deepest = std::max(deepest, reach[r]);
  }
  first[R] = follows.size();
  // 4. The paths after them, one depth at a time: paths[o * deepest + d], kNone past the path's end.
  const size_t M = follows.size(), stride = size_t(deepest);
  std::vector<token_t> paths(M * stride, kNone);
  for (const Follow& f : follows) prefetch(f.at);
  for (int64_t d = 0; d < deepest; ++d) {
    bool any = false;
    for (size_t o = 0; o < M; ++o) {
      Follow& f = follows[o];
      if (f.at == 0 || d >= reach[f.r]) continue;
      const Slot& s = at(f.at);
      paths[o * stride + size_t(d)] = s.token;
      prefetch(f.at = s.next);
      any = true;
    }
    if (!any) break;
  }
  // 5. Each request's trie.
  for (size_t r = 0; r < R; ++r) {
    if (first[r + 1] > first[r]) {
      const std::span<const token_t> mine(paths.data() + first[r] * stride, (first[r + 1] - first[r]) * stride);
      trie(mine, stride, best[r], out);
    }
    out.offsets[r + 1] = int64_t(out.tokens.size());
  }
  return out;
}

void RecentStore::trie(std::span<const token_t> paths, size_t stride, int64_t best, RecentDrafts& out) const {
  // One depth at a time: each occurrence's node at the previous depth; siblings sorted by token.
  const size_t M = paths.size() / stride;
  std::vector<int32_t> node_of(M, -1);
  std::vector<double> count;  // per local node: the occurrences through it
  std::vector<Step> steps;
  steps.reserve(M);
  const size_t base = out.tokens.size();
  const double damping = std::pow(match_damping_, double(max_match_ - best));
  for (size_t d = 0; d < stride; ++d) {
    steps.clear();
    for (size_t m = 0; m < M; ++m) {
      const token_t t = paths[m * stride + d];
      if (t != kNone && (d == 0 || node_of[m] >= 0)) steps.push_back({node_of[m], t, m});
    }
    if (steps.empty()) break;
    std::sort(steps.begin(), steps.end(), [](const Step& x, const Step& y) {
      return x.parent != y.parent ? x.parent < y.parent : x.token < y.token;
    });
    std::fill(node_of.begin(), node_of.end(), -1);  // an occurrence whose path ended stays out
    for (size_t i = 0; i < steps.size();) {
      size_t j = i;
      while (j < steps.size() && steps[j].parent == steps[i].parent && steps[j].token == steps[i].token) ++j;
      const int32_t node = int32_t(out.tokens.size() - base);
      const double c = double(j - i);
      const int32_t parent = steps[i].parent;
      const double w = parent < 0 ? c / double(M) * damping : c / count[size_t(parent)];
      out.tokens.push_back(int64_t(steps[i].token));
      out.parents.push_back(parent);
      out.weights.push_back(float(std::clamp(w, 0.0, 1.0)));
      count.push_back(c);
      for (size_t k = i; k < j; ++k) node_of[steps[k].occurrence] = node;
      i = j;
    }
  }
}

}  // namespace sssd
