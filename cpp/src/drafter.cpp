#include "sssd/drafter.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>

#include "sssd/check.h"
#include "sssd/continuation_tree.h"
#include "sssd/coro.h"
#include "sssd/parallel.h"
#include "sssd/parent_tree.h"
#include "sssd/tree_merger.h"

namespace sssd {

// Datastore queries interleaved per thread (see coro.h): enough misses in
// flight to hide memory latency, few enough that their trees stay in cache.
constexpr size_t kInterleave = 16;

// What one request of an interleaved group holds from its first merge phase to its last: the
// trees its draft merges (trees[0]: the datastore's, empty until it is asked) and their storage.
struct Drafter::Slot {
  std::vector<SourceTree> trees;
  TreeMerger merger;
  ContinuationTree datastore_tree, copy_tree;
  // One tree per external source tag (index tag - kExternal), and its nodes' q.
  ContinuationTree external_trees[kMaxSources - int(Source::kExternal)];
  std::vector<float> external_q[kMaxSources - int(Source::kExternal)];
};

// Per-thread buffers, kept from call to call (thread_scratch).
struct Drafter::Scratch {
  Slot slots[kInterleave];
  std::vector<Task<QueryStats>> queries;
  std::vector<uint32_t> asked;  // the slots whose datastore is queried, in the queries' order
  std::vector<uint32_t> external_ids;
  std::vector<double> external_path;
  std::vector<token_t> copy_path, copy_edited;
};

Drafter::Scratch& Drafter::thread_scratch() {
  thread_local std::unique_ptr<Scratch> scratch;
  if (!scratch) scratch = std::make_unique<Scratch>();
  return *scratch;
}

// The datastore's priorities are at most this (its tree's scale and level as collect() left them
// in the placeholder, its table cells at their best, probabilities at 1 give or take float sums).
static double datastore_bound(const DrafterParams& p, const SourceTree& placeholder) {
  constexpr double kSlack = 1.001;
  const double level = placeholder.level > 1 ? std::pow(placeholder.level, p.datastore.deepest() - 1) : 1.0;
  return placeholder.scale * p.scores.max_priority(Source::kDatastore) * level * kSlack;
}

void check_params(const DrafterParams& p) {
  check_query(p.datastore);
  SSSD_CHECK_ARG(p.input_max_match >= 1 && p.input_max_match <= 64,
                 "input_max_match must be in [1, 64], got ", p.input_max_match);
  SSSD_CHECK_ARG(p.input_branch_len >= 1 && p.input_branch_len <= 255,
                 "input_branch_len must be in [1, 255], got ", p.input_branch_len);
  SSSD_CHECK_ARG(p.input_max_nodes >= 1, "input_max_nodes must be >= 1");
  SSSD_CHECK_ARG(p.copy_min_match >= 1 && p.copy_min_match <= 1 << 20, "copy_min_match must be in [1, 2^20], got ",
                 p.copy_min_match);
  SSSD_CHECK_ARG(p.copy_branch_per_match >= 0 && p.copy_branch_per_match <= 1e6,
                 "copy_branch_per_match must be in [0, 1e6], got ", p.copy_branch_per_match);
  SSSD_CHECK_ARG(p.copy_max_branch_len >= 0 && p.copy_max_branch_len <= kMaxBudget,
                 "copy_max_branch_len must be in [0, ", kMaxBudget, "], got ", p.copy_max_branch_len);
  SSSD_CHECK_ARG(p.copy_occurrences >= 1 && p.copy_occurrences <= SuffixAutomaton::kKeep,
                 "copy_occurrences must be in [1, ", SuffixAutomaton::kKeep, "], got ", p.copy_occurrences);
  SSSD_CHECK_ARG(p.copy_rate > 0 && p.copy_rate <= 1, "copy_rate must be in (0, 1], got ", p.copy_rate);
  SSSD_CHECK_ARG(p.copy_evidence > 0 && p.copy_evidence <= 1e6, "copy_evidence must be in (0, 1e6], got ",
                 p.copy_evidence);
  SSSD_CHECK_ARG(p.copy_half_life >= 0 && p.copy_half_life <= 1e9, "copy_half_life must be in [0, 1e9], got ",
                 p.copy_half_life);
  SSSD_CHECK_ARG(p.copy_exclusion >= 0 && p.copy_exclusion <= 1, "copy_exclusion must be in [0, 1], got ",
                 p.copy_exclusion);
  SSSD_CHECK_ARG(p.copy_edit_weight >= 0 && p.copy_edit_weight <= 1e6, "copy_edit_weight must be in [0, 1e6], got ",
                 p.copy_edit_weight);
  SSSD_CHECK_ARG(p.vocab_size <= uint64_t(kMaxTokenId) + 1, "vocab_size must be <= 2^32 - 1, got ",
                 p.vocab_size);
}

void Drafter::set_num_threads(int num_threads) {
  threads_.store(resolve_threads(num_threads), std::memory_order_relaxed);
}

Drafter::Drafter(std::shared_ptr<const Datastore> datastore, DrafterParams params, int num_threads)
    : datastore_(std::move(datastore)), params_(std::move(params)), threads_(resolve_threads(num_threads)) {
  check_params(params_);
  SSSD_CHECK_ARG(num_threads >= 0, "num_threads must be >= 0 (0: OpenMP default), got ", num_threads);
  // Drafts copy the datastore's ids: they must be ids of the caller's vocabulary.
  SSSD_CHECK_ARG(!datastore_ || !params_.use_datastore || params_.vocab_size == 0 ||
                     datastore_->vocab_size() <= params_.vocab_size,
                 "the datastore holds token ids up to ", datastore_ ? datastore_->vocab_size() - 1 : 0,
                 ", outside the vocabulary (vocab_size ", params_.vocab_size, "); it was built with another tokenizer");
}

void Drafter::check_tokens(std::span<const token_t> tokens, const char* what) const {
  const uint64_t limit = params_.vocab_size ? params_.vocab_size : uint64_t(kMaxTokenId) + 1;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= limit) {
      throw std::invalid_argument(detail::concat(
          what, "[", i, "] = ", tokens[i], " is outside the vocabulary (ids must be < ", limit, ")",
          tokens[i] == kSeparator ? "; it is the document separator id" : ""));
    }
  }
}

static CopySettings copy_settings(const DrafterParams& p) {
  if (!p.use_input || p.copy_max_branch_len == 0) return {};
  return {p.copy_max_tokens, p.copy_min_match, p.copy_half_life};
}

std::unique_ptr<RequestTrie> Drafter::make_trie() const {
  // Without the input source the trie stores no n-grams, only the context.
  return params_.use_input
             ? std::make_unique<RequestTrie>(params_.input_max_match + params_.input_branch_len,
                                             params_.input_max_nodes, copy_settings(params_))
             : std::make_unique<RequestTrie>(2, 1);
}

void Drafter::open(uint64_t id, std::span<const token_t> prompt) {
  check_tokens(prompt, "prompt");
  auto trie = make_trie();
  trie->extend(prompt);
  std::unique_lock lock(mu_);
  SSSD_CHECK_ARG(!requests_.count(id), "request ", id, " is already open");
  requests_.emplace(id, std::move(trie));
}

void Drafter::extend(uint64_t id, std::span<const token_t> tokens) {
  check_tokens(tokens, "tokens");
  std::unique_lock lock(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) throw UnknownRequest(detail::concat("unknown request id ", id));
  it->second->extend(tokens);
}

void Drafter::extend_batch(std::span<const uint64_t> ids, std::span<const int64_t> offsets,
                           std::span<const token_t> tokens) {
  check_offsets(offsets, ids.size(), tokens.size());
  check_tokens(tokens, "tokens");
  std::unique_lock lock(mu_);
  std::vector<RequestTrie*> tries(ids.size());
  for (size_t b = 0; b < ids.size(); ++b) {
    auto it = requests_.find(ids[b]);
    if (it == requests_.end()) throw UnknownRequest(detail::concat("unknown request id ", ids[b]));
    tries[b] = it->second.get();
  }
  for (size_t b = 0; b < ids.size(); ++b) {
    tries[b]->extend(tokens.subspan(size_t(offsets[b]), size_t(offsets[b + 1] - offsets[b])));
  }
}

void Drafter::close(uint64_t id) {
  std::unique_ptr<RequestTrie> victim;  // freed outside the lock
  std::unique_lock lock(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) throw UnknownRequest(detail::concat("unknown request id ", id));
  victim = std::move(it->second);
  requests_.erase(it);
}

bool Drafter::contains(uint64_t id) const {
  std::shared_lock lock(mu_);
  return requests_.count(id) != 0;
}

size_t Drafter::num_requests() const {
  std::shared_lock lock(mu_);
  return requests_.size();
}

std::vector<uint64_t> Drafter::request_ids() const {
  std::shared_lock lock(mu_);
  std::vector<uint64_t> ids;
  ids.reserve(requests_.size());
  for (const auto& kv : requests_) ids.push_back(kv.first);
  return ids;
}

std::vector<token_t> Drafter::context(uint64_t id) const {
  std::shared_lock lock(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) throw UnknownRequest(detail::concat("unknown request id ", id));
  const auto t = it->second->tokens();
  return {t.begin(), t.end()};
}

size_t Drafter::request_memory(uint64_t id) const {
  std::shared_lock lock(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) throw UnknownRequest(detail::concat("unknown request id ", id));
  return it->second->memory_bytes();
}

void Drafter::check_compatible(const DrafterParams& p) const {
  check_params(p);
  SSSD_CHECK_ARG(p.vocab_size == params_.vocab_size, "params for vocab_size ", p.vocab_size,
                 " cannot draft for a drafter of vocab_size ", params_.vocab_size);
  SSSD_CHECK_ARG(!p.use_input || params_.use_input,
                 "params use the input source but this drafter's request tries store no n-grams");
  SSSD_CHECK_ARG(!p.use_input || p.input_max_match + p.input_branch_len <=
                                     params_.input_max_match + params_.input_branch_len,
                 "params need input tries of depth ", p.input_max_match + p.input_branch_len,
                 " (input_max_match + input_branch_len); this drafter's hold ",
                 params_.input_max_match + params_.input_branch_len);
}

void Drafter::draft_group(const DrafterParams& p, const RequestTrie* const* tries, const int32_t* budgets,
                          const CallInputs& in, size_t begin, size_t end, Scratch& s, DraftTree* out) const {
  // Every source but the datastore first, merged while its best candidate beats anything the
  // datastore could offer: a request whose budget fills that way (a confident copy) needs no query.
  const bool use_ds = p.use_datastore && datastore_;
  s.queries.clear();
  s.asked.clear();
  for (size_t b = begin; b < end; ++b) {
    Slot& slot = s.slots[b - begin];
    collect(p, *tries[b], budgets[b], in, b, s, slot);
    slot.merger.start(slot.trees, p.scores, out[b]);
    const double floor = use_ds ? datastore_bound(p, slot.trees[0]) : -std::numeric_limits<double>::infinity();
    slot.merger.run(slot.trees, p.scores, budgets[b], out[b], floor);
    if (use_ds && out[b].size() < size_t(std::max(budgets[b], 0))) {
      s.asked.push_back(uint32_t(b - begin));
      s.queries.push_back(datastore_->query_task(tries[b]->tokens(), p.datastore, &slot.datastore_tree));
    }
  }
  // The others' queries run interleaved; each of those requests then merges on with its datastore tree.
  if (use_ds) {
    const size_t drafted = size_t(std::count_if(budgets + begin, budgets + end, [](int32_t x) { return x > 0; }));
    drafted_.fetch_add(drafted, std::memory_order_relaxed);
    skipped_.fetch_add(drafted - s.queries.size(), std::memory_order_relaxed);
  }
  run_interleaved(std::span<Task<QueryStats>>(s.queries));
  for (size_t i = 0; i < s.asked.size(); ++i) {
    const size_t b = begin + s.asked[i];
    Slot& slot = s.slots[s.asked[i]];
    const QueryStats qs = s.queries[i].result();
    if (qs.match_len > 0) {
      SourceTree& t = slot.trees[0];
      SourceTree v = slot.datastore_tree.view(Source::kDatastore, qs.match_len, p.datastore.deepest());
      v.scale = t.scale;
      v.level = t.level;
      t = v;
      slot.merger.add(slot.trees, 0, p.scores);
    }
    slot.merger.run(slot.trees, p.scores, budgets[b], out[b]);
  }
}

void Drafter::collect(const DrafterParams& p, const RequestTrie& trie, int budget, const CallInputs& in, size_t b,
                      Scratch& s, Slot& slot) const {
  slot.trees.assign(1, SourceTree{});  // the datastore's place: its index ranks it first among equals
  if (budget <= 0) return;
  const std::span<const token_t> context = trie.tokens();
  if (p.use_input) {
    const int longest = int(std::min<size_t>(context.size(), size_t(p.input_max_match)));
    for (int len = longest; len >= 1; --len) {
      SourceTree t = trie.continuations(len);
      if (!t.empty()) {
        t.max_depth = std::min(t.max_depth, p.input_branch_len);
        slot.trees.push_back(t);
      }
    }
    add_copy(p, trie.copy(), context, s, slot);
  }
  if (in.external || in.recent) {
    // One tree per tag, in tag order, whichever input a tag's nodes came in.
    bool used[kMaxSources] = {};
    if (in.external) stage_external(*in.external, b, s, slot, used);
    if (in.recent) stage_external(*in.recent, b, s, slot, used);
    constexpr int kFirst = int(Source::kExternal);
    for (int tag = kFirst; tag < kMaxSources; ++tag) {
      if (!used[tag]) continue;
      SourceTree t = slot.external_trees[tag - kFirst].view(Source(tag), 0, kMaxBudget);
      t.total = 1.0;
      t.draft_probs = slot.external_q[tag - kFirst].data();
      slot.trees.push_back(t);
    }
  }
  if (in.factors) {
    const size_t row = b * size_t(kMaxSources);
    for (SourceTree& t : slot.trees) {
      t.scale *= double(in.factors->scale[row + size_t(t.source)]);
      t.level *= double(in.factors->level[row + size_t(t.source)]);
    }
  }
}

void Drafter::add_copy(const DrafterParams& p, const CopyIndex& copy, std::span<const token_t> context,
                       Scratch& s, Slot& slot) {
  if (p.copy_max_branch_len == 0 || !copy.enabled()) return;
  SuffixAutomaton::Repeat r = copy.repeat();
  if (r.length < uint32_t(p.copy_min_match) || r.count == 0) {
    // No repeat long enough: where the copy diverged, does the context rejoin its source?
    const CopyIndex::Resync y = copy.resync(context);
    if (y.length == 0) return;
    r = {};
    r.length = y.length;
    r.count = 1;
    r.ends[0] = y.end;
  }
  // As deep as allowed (the rate's powers rank deep nodes low enough), or adaptive: a longer
  // match followed further.
  const double wanted = std::min(1e6, double(r.length) * p.copy_branch_per_match);
  const int depth = p.copy_branch_per_match > 0
                        ? std::min(p.copy_max_branch_len, std::max(p.input_branch_len, int(wanted)))
                        : p.copy_max_branch_len;
  ContinuationTree& t = slot.copy_tree;
  t.clear();
  std::vector<token_t>& path = s.copy_path;
  std::vector<token_t>& edited = s.copy_edited;
  for (int i = 0; i < std::min(r.count, p.copy_occurrences); ++i) {
    const size_t start = size_t(r.ends[i]) + 1;  // < context.size(): an earlier end
    copy.follow(context, start, size_t(depth), false, path);
    const CopyIndex::Edit* edit = nullptr;
    if (p.copy_edit_weight > 0 && !copy.edits().empty()) {  // the same with the request's edits again
      edit = copy.follow(context, start, size_t(depth), true, edited);
    }
    if (!edit) {
      t.add_path(path);
      continue;
    }
    // Both, weighed by how often the first edit on the way was made again where it could be.
    const double q = std::min(1.0, edit->odds() * p.copy_edit_weight);
    t.add_path(path, float(1.0 - q));
    t.add_path(edited, float(q));
  }
  SourceTree v = t.view(Source::kCopy, int(std::min<uint32_t>(r.length, 1u << 20)), depth);
  v.depth_rate = copy.rate(p.copy_rate, p.copy_evidence);
  // The other sources' guesses differ from the copy's (where they agree, the copy's node is the
  // same draft node): they need the copy to be wrong.
  for (SourceTree& other : slot.trees) other.scale *= 1.0 - p.copy_exclusion * v.depth_rate;
  slot.trees.push_back(v);
}

void Drafter::stage_external(const ExternalTrees& external, size_t b, Scratch& s, Slot& slot, bool* used) {
  const size_t begin = size_t(external.offsets[b]), end = size_t(external.offsets[b + 1]);
  if (begin == end) return;
  constexpr int kFirst = int(Source::kExternal);
  const size_t n = end - begin;
  s.external_ids.resize(n);
  s.external_path.resize(n);
  const auto tokens = external.tokens.subspan(begin, n);
  const auto parents = external.parents.subspan(begin, n);
  const auto weights = external.weights.subspan(begin, n);
  for (size_t k = 0; k < n; ++k) {
    const int tag = external.sources.empty() ? kFirst : int(external.sources[begin + k]);
    ContinuationTree& tree = slot.external_trees[tag - kFirst];
    std::vector<float>& q = slot.external_q[tag - kFirst];
    if (!used[tag]) {
      used[tag] = true;
      tree.clear();
      q.assign(1, std::nanf(""));
    }
    // Node k becomes tree node external_ids[k]; its weight is the path probability.
    add_parent_node(tree, tokens, parents, weights, PathWeight::kConditional, k, s.external_ids, s.external_path);
    q.resize(tree.nodes().size(), std::nanf(""));
    q[s.external_ids[k]] = external.q.empty() ? std::nanf("") : external.q[begin + k];
  }
}

// A RecentQuery fits a call of n requests whose caller-supplied trees are `external`.
static void check_recent(const RecentQuery& recent, size_t n, const ExternalTrees* external) {
  SSSD_CHECK_ARG(recent.store, "the recent outputs' query needs a store");
  SSSD_CHECK_ARG(recent.budgets.size() == n, "got ", n, " request ids but ", recent.budgets.size(),
                 " budgets for the recent outputs");
  const int tag = recent.tag;
  SSSD_CHECK_ARG(tag >= int(Source::kExternal) && tag < int(Source::kCopy), "the recent outputs' source tag ", tag,
                 " must be in [", int(Source::kExternal), ", ", int(Source::kCopy), ")");
  const bool taken = external && !external->tokens.empty() &&
                     (external->sources.empty() ? tag == int(Source::kExternal)
                                                : std::find(external->sources.begin(), external->sources.end(),
                                                            uint8_t(tag)) != external->sources.end());
  SSSD_CHECK_ARG(!taken, "the recent outputs' source tag ", tag, " is an external source's too");
}

Drafter::RecentInput Drafter::ask_recent(const RecentQuery& recent, std::span<const uint64_t> ids,
                                         std::span<const RequestTrie* const> tries) const {
  const size_t n = ids.size(), K = size_t(recent.store->max_match());
  std::vector<int64_t> queries(n * K, -1);  // each context's last K tokens, newest first
  for (size_t b = 0; b < n; ++b) {
    const auto ctx = tries[b]->tokens();
    for (size_t j = 0; j < std::min(K, ctx.size()); ++j) queries[b * K + j] = int64_t(ctx[ctx.size() - 1 - j]);
  }
  RecentInput in;
  in.drafts = recent.store->propose(ids, queries, recent.budgets);
  in.tokens.assign(in.drafts.tokens.begin(), in.drafts.tokens.end());  // ids <= kMaxTokenId
  check_tokens(in.tokens, "recent outputs' tokens");  // the store's tokens, from this drafter's requests
  in.tags.assign(in.tokens.size(), uint8_t(recent.tag));
  return in;
}

void Drafter::draft(std::span<const uint64_t> ids, std::span<const int32_t> budgets,
                    std::vector<DraftTree>& out, const ExternalTrees* external, const DrafterParams* params,
                    const SourceFactors* factors, const RecentQuery* recent) const {
  const size_t n = ids.size();
  if (params) check_compatible(*params);
  const DrafterParams& p = params ? *params : params_;
  SSSD_CHECK_ARG(budgets.size() == n, "got ", n, " request ids but ", budgets.size(), " budgets");
  for (size_t b = 0; b < n; ++b) {
    SSSD_CHECK_ARG(budgets[b] >= 0 && budgets[b] <= kMaxBudget, "budget[", b, "] = ", budgets[b],
                   " is outside [0, ", kMaxBudget, "]");
  }
  if (external) {
    SSSD_CHECK_ARG(external->offsets.size() == n + 1, "external offsets must have ", n + 1,
                   " entries, got ", external->offsets.size());
    const size_t total = external->tokens.size();
    SSSD_CHECK_ARG(external->parents.size() == total && external->weights.size() == total &&
                       (external->q.empty() || external->q.size() == total) &&
                       (external->sources.empty() || external->sources.size() == total),
                   "external tokens, parents, weights, q and sources must have the same length");
    SSSD_CHECK_ARG(external->offsets[0] == 0 && size_t(external->offsets[n]) == total,
                   "external offsets must start at 0 and end at the number of nodes");
    for (size_t b = 0; b < n; ++b) {
      const int64_t begin = external->offsets[b], end = external->offsets[b + 1];
      SSSD_CHECK_ARG(begin <= end, "external offsets must be non-decreasing");
      const auto parents = external->parents.subspan(size_t(begin), size_t(end - begin));
      check_parents(parents, "external candidates");
      for (int64_t i = begin; i < end; ++i) {
        const float w = external->weights[size_t(i)];
        SSSD_CHECK_ARG(w >= 0.0f && w <= 1.0f, "external weight[", i, "] = ", w, " is outside [0, 1]");
        if (!external->q.empty()) {
          const float q = external->q[size_t(i)];
          SSSD_CHECK_ARG(std::isnan(q) || (q >= 0.0f && q <= 1.0f), "external q[", i, "] = ", q,
                         " is outside [0, 1] (NaN: none)");
        }
        if (!external->sources.empty()) {
          const int tag = external->sources[size_t(i)];
          SSSD_CHECK_ARG(tag >= int(Source::kExternal) && tag < int(Source::kCopy), "external source[", i, "] = ",
                         tag, " must be in [", int(Source::kExternal), ", ", int(Source::kCopy), ")");
          const int32_t p = parents[size_t(i - begin)];
          SSSD_CHECK_ARG(p < 0 || external->sources[size_t(begin + p)] == tag, "external node ", i,
                         " hangs under a node of another source");
        }
      }
    }
    check_tokens(external->tokens, "external tokens");
  }

  if (factors) {
    const size_t cells = n * size_t(kMaxSources);
    SSSD_CHECK_ARG(factors->scale.size() == cells && factors->level.size() == cells, "source factors must have ", n,
                   " x ", kMaxSources, " entries each, got ", factors->scale.size(), " and ", factors->level.size());
    for (size_t i = 0; i < cells; ++i) {
      const float a = factors->scale[i], l = factors->level[i];
      SSSD_CHECK_ARG(std::isfinite(a) && a >= 0 && std::isfinite(l) && l >= 0, "source factors[", i / kMaxSources,
                     ", ", i % kMaxSources, "] = (", a, ", ", l, ") must be finite and >= 0");
    }
  }

  if (recent) check_recent(*recent, n, external);

  std::shared_lock lock(mu_);
  std::vector<const RequestTrie*> tries(n);
  for (size_t b = 0; b < n; ++b) {
    auto it = requests_.find(ids[b]);
    if (it == requests_.end()) throw UnknownRequest(detail::concat("unknown request id ", ids[b]));
    tries[b] = it->second.get();
  }
  RecentInput recent_input;
  if (recent) recent_input = ask_recent(*recent, ids, tries);
  const ExternalTrees recent_trees = recent_input.trees();
  const CallInputs in{external, recent ? &recent_trees : nullptr, factors};
  out.resize(n);
  // Work is handed out by groups of interleaved requests. Waking another
  // thread costs tens of microseconds to milliseconds on small VMs, so a
  // thread only joins for at least kGroupsPerThread groups of work.
  constexpr size_t kGroupsPerThread = 4;
  const size_t groups = (n + kInterleave - 1) / kInterleave;
  const int threads = std::max(1, std::min<int>(threads_.load(std::memory_order_relaxed), int(groups / kGroupsPerThread)));
  ExceptionCapture capture;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    // Made under the capture too: it allocates, and nothing may throw out of
    // the region. If it failed, capture.run skips every body below.
    Scratch* scratch = nullptr;
    capture.run([&] { scratch = &thread_scratch(); });
#pragma omp for schedule(dynamic, 1)
    for (size_t g = 0; g < groups; ++g) {
      capture.run([&] {
        draft_group(p, tries.data(), budgets.data(), in, g * kInterleave, std::min(n, (g + 1) * kInterleave),
                    *scratch, out.data());
      });
    }
  }
  capture.rethrow();
}

// The input source's trees for a context that has no request trie: the same
// trees continuations(len) of a RequestTrie of depth `depth` over `context`
// would give, from one scan. Every occurrence of the context's last token
// (but the final one) is matched backwards to find for which suffix lengths
// it counts; its continuation, sorted once, is staged into the tree of each
// of them (the order of the longest cut holds for every shorter cut).
static void input_trees(std::span<const token_t> context, int longest, int depth, int branch_len,
                        std::vector<ContinuationTree>& trees, std::vector<SourceTree>& out) {
  const size_t n = context.size();
  if (n < 2 || longest < 1) return;
  const token_t last = context[n - 1];
  struct Occurrence {
    uint32_t start;  // of the continuation
    int match;       // context tokens matched backwards (1..longest)
  };
  std::vector<Occurrence> occ;
  for (size_t j = 0; j + 1 < n; ++j) {
    if (context[j] != last) continue;
    int m = 1;
    while (m < longest && j >= size_t(m) && context[j - size_t(m)] == context[n - 1 - size_t(m)]) ++m;
    occ.push_back({uint32_t(j + 1), m});
  }
  if (occ.empty()) return;
  const size_t cut = size_t(depth - 1);
  auto path = [&](const Occurrence& o, size_t len) {
    return context.subspan(o.start, std::min(len, n - o.start));
  };
  std::sort(occ.begin(), occ.end(), [&](const Occurrence& a, const Occurrence& b) {
    const auto x = path(a, cut), y = path(b, cut);
    return std::lexicographical_compare(x.begin(), x.end(), y.begin(), y.end());
  });
  if (trees.size() < size_t(longest)) trees.resize(size_t(longest));
  for (int len = longest; len >= 1; --len) {
    ContinuationTree& t = trees[size_t(len - 1)];
    t.clear();
    const size_t keep = size_t(depth - len);
    bool any = false;
    for (const Occurrence& o : occ) {
      if (o.match < len) continue;
      const auto p = path(o, keep);
      t.stage(p, p.size() < keep ? ContinuationTree::End::kStream : ContinuationTree::End::kLength);
      any = true;
    }
    if (!any) continue;
    t.commit_runs(-1);
    out.push_back(t.view(Source::kInput, len, std::min(depth - len, branch_len)));
  }
}

DraftTree Drafter::draft_context(std::span<const token_t> context, int budget) const {
  SSSD_CHECK_ARG(budget >= 0 && budget <= kMaxBudget, "budget = ", budget, " is outside [0, ",
                 kMaxBudget, "]");
  check_tokens(context, "prefix");  // also refuses the separator id
  const DrafterParams& p = params_;
  const int depth = p.input_max_match + p.input_branch_len;  // a request trie's depth
  DraftTree out;
  if (p.use_input && context.size() * size_t(depth) > p.input_max_nodes) {
    // A context this long would fill a request trie past its cap, which
    // changes the input source's counts: draft through a real trie.
    const auto trie = make_trie();
    trie->extend(context);
    const RequestTrie* tries[1] = {trie.get()};
    draft_group(p, tries, &budget, CallInputs{}, 0, 1, thread_scratch(), &out);
    return out;
  }
  // Every source asked up front and merged at once (draft() merges in two phases: tests compare them).
  thread_local std::vector<ContinuationTree> inputs;
  Scratch& s = thread_scratch();
  Slot& slot = s.slots[0];
  slot.trees.clear();
  if (budget > 0) {
    if (p.use_datastore && datastore_) {
      auto task = datastore_->query_task(context, p.datastore, &slot.datastore_tree);
      const QueryStats qs = run(task);
      if (qs.match_len > 0) {
        slot.trees.push_back(slot.datastore_tree.view(Source::kDatastore, qs.match_len, p.datastore.deepest()));
      }
    }
    if (p.use_input) {
      input_trees(context, int(std::min<size_t>(context.size(), size_t(p.input_max_match))), depth,
                  p.input_branch_len, inputs, slot.trees);
      const CopySettings cs = copy_settings(p);
      if (cs.max_tokens > 0) {  // the copy index a request of this context would hold
        CopyIndex copy(cs.max_tokens, cs.min_match, cs.half_life);
        for (size_t i = 0; i < context.size(); ++i) copy.append(context.first(i), context[i]);
        add_copy(p, copy, context, s, slot);
      }
    }
  }
  slot.merger.merge(slot.trees, p.scores, budget, out);
  return out;
}

}  // namespace sssd
