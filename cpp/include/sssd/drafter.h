// Drafter: the SSSD drafting engine. Owns one RequestTrie per open request,
// shares one read-only Datastore, and drafts a whole batch in one call,
// parallel over requests with OpenMP.
//
// Thread safety: every method may be called from several threads at once.
// draft() and the other const methods share a reader lock; open(), extend()
// and close() take it exclusively (they are O(tokens) and short).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "sssd/datastore.h"
#include "sssd/draft_tree.h"
#include "sssd/recent_store.h"
#include "sssd/request_trie.h"
#include "sssd/score_table.h"

namespace sssd {

/// Largest draft budget accepted (nodes per request per step).
inline constexpr int kMaxBudget = 4096;

struct DrafterParams {
  DatastoreQuery datastore;          ///< datastore source retrieval
  bool use_datastore = true;         ///< draft from the datastore (if one is attached)
  bool use_input = true;             ///< draft from the request's own tokens
  int input_max_match = 4;           ///< P: longest context suffix matched in the input
  int input_branch_len = 16;         ///< longest input continuation
  size_t input_max_nodes = size_t(1) << 22;  ///< per-request trie cap (<= ~100 B/node)
  // The copy source (copy_index.h): the longest earlier occurrence of the context's suffix,
  // followed deep; part of the input source (use_input), its nodes tagged Source::kCopy.
  int copy_min_match = 8;            ///< shortest repeat followed (and that counts as evidence)
  double copy_branch_per_match = 0;  ///< adaptive depth: a repeat of m tokens followed m times this far (0: off) ...
  int copy_max_branch_len = 64;      ///< ... up to this many tokens (0: no copy source)
  int copy_occurrences = 2;          ///< earlier occurrences followed (1..SuffixAutomaton::kKeep)
  double copy_rate = 0.9;            ///< prior probability that a copy continues one more token
  double copy_evidence = 4;          ///< the prior's weight, in trials of the request's own evidence
  double copy_half_life = 32;        ///< trials after which the request's evidence weighs half
  double copy_exclusion = 1;         ///< other sources' priorities times (1 - this * the copy's rate)
  double copy_edit_weight = 1;       ///< an edited path's weight: this times its edit's odds of being made again (0: off)
  size_t copy_max_tokens = size_t(1) << 20;  ///< per-request automaton cap (<= 180 B/token)
  ScoreTable scores;                 ///< discounts of the merge
  uint64_t vocab_size = 0;           ///< token ids must be < this (0: any id < 2^32 - 1)
};

/// Caller-supplied draft candidates for a batch (from model drafters or any
/// other source), in CSR form: request b owns entries [offsets[b],
/// offsets[b+1]). Parents index within the request's slice (-1: root),
/// precede their children and belong to the same source. Each source
/// (sources[i], a tag >= kExternal; all kExternal when empty) becomes one
/// tree of the merge, weighed by its own score-table cells.
struct ExternalTrees {
  std::span<const int64_t> offsets;
  std::span<const token_t> tokens;
  std::span<const int32_t> parents;
  std::span<const float> weights;  ///< ranking: conditional probability of the node given its parent, in [0, 1]
  std::span<const float> q;        ///< the real draft probability q(token | parent path), NaN if none; may be empty
  std::span<const uint8_t> sources;  ///< per-node source tag; may be empty
};

/// Per-request corrections of each source's priorities (a request's own measured acceptance by
/// source, sssd/source_evidence.py): request b's candidates from source tag s have their priority
/// multiplied by scale[b * kMaxSources + s] * level[b * kMaxSources + s]^(depth - 1).
struct SourceFactors {
  std::span<const float> scale;  ///< [n * kMaxSources], finite and >= 0
  std::span<const float> level;  ///< [n * kMaxSources], finite and >= 0
};

/// The other requests' recent outputs (recent_store.h), asked inside Drafter::draft for the
/// whole batch, so that their proposals never leave C++: each request's context (its tokens in
/// the drafter) is looked up, and request b's proposals (budgets[b] deep at most; 0: not asked)
/// become its tree of source `tag`, merged as an external source of that tag would be.
struct RecentQuery {
  const RecentStore* store = nullptr;
  int tag = int(Source::kExternal);  ///< in [kExternal, kCopy), no other external source's
  std::span<const int64_t> budgets;  ///< [n], >= 0
};

/// Validates drafter parameters; throws std::invalid_argument naming the field.
void check_params(const DrafterParams& p);

class Drafter {
 public:
  /// `datastore` may be null (input source only).
  Drafter(std::shared_ptr<const Datastore> datastore, DrafterParams params, int num_threads = 0);

  /// Starts request `id` with its prompt. Throws std::invalid_argument if the
  /// id is already open or a token is outside the vocabulary.
  void open(uint64_t id, std::span<const token_t> prompt);
  /// Appends accepted tokens to request `id`. Throws UnknownRequest if unknown.
  void extend(uint64_t id, std::span<const token_t> tokens);
  /// Appends tokens to many requests under one lock: request ids[b] gets
  /// tokens[offsets[b] .. offsets[b+1]). All ids are checked before any
  /// request changes.
  void extend_batch(std::span<const uint64_t> ids, std::span<const int64_t> offsets,
                    std::span<const token_t> tokens);
  /// Ends request `id` and frees its state. Throws UnknownRequest if unknown.
  void close(uint64_t id);

  bool contains(uint64_t id) const;
  size_t num_requests() const;
  std::vector<uint64_t> request_ids() const;
  /// Tokens of request `id` so far (a copy).
  std::vector<token_t> context(uint64_t id) const;
  /// Bytes held by request `id`'s trie.
  size_t request_memory(uint64_t id) const;

  /// Drafts for requests ids[b] with budgets[b] (0 <= budget <= kMaxBudget)
  /// into out[b]. `external`, if given, adds one more source per request.
  /// `params`, if given, replaces the drafter's retrieval parameters and
  /// discounts for this call (e.g. the calibration entry of this step's
  /// budget); it must fit the request tries (check_compatible).
  /// `factors`, if given, corrects each request's sources (SourceFactors).
  /// `recent`, if given, adds the recent outputs' proposals (RecentQuery).
  /// Throws UnknownRequest for an unknown id, std::invalid_argument for a
  /// bad budget, incompatible params, a malformed external tree or factors;
  /// `out` is then unspecified.
  void draft(std::span<const uint64_t> ids, std::span<const int32_t> budgets,
             std::vector<DraftTree>& out, const ExternalTrees* external = nullptr,
             const DrafterParams* params = nullptr, const SourceFactors* factors = nullptr,
             const RecentQuery* recent = nullptr) const;

  /// Throws std::invalid_argument unless `p` can draft over this drafter's
  /// request tries: valid, the same vocabulary, the input source only if the
  /// tries store n-grams, and input_max_match + input_branch_len within
  /// their depth.
  void check_compatible(const DrafterParams& p) const;

  /// Drafts once for a context that is not an open request (its trie is
  /// built for this call only).
  DraftTree draft_context(std::span<const token_t> context, int budget) const;

  /// Datastore queries since the drafter was made: the requests drafted with a budget and the
  /// datastore on, and how many of them it skipped (their budget filled, before it was asked,
  /// with candidates of other sources above anything it could offer).
  struct QueryCounts {
    uint64_t drafted = 0, skipped = 0;
  };
  QueryCounts datastore_queries() const {
    return {drafted_.load(std::memory_order_relaxed), skipped_.load(std::memory_order_relaxed)};
  }

  const DrafterParams& params() const { return params_; }
  const std::shared_ptr<const Datastore>& datastore() const { return datastore_; }
  int num_threads() const { return threads_.load(std::memory_order_relaxed); }
  /// Batch drafting's OpenMP threads from the next call on (an engine lowers them while other
  /// processes hold cores, so that its threads do not spin against them); 0: all cores.
  void set_num_threads(int num_threads);

  /// Throws std::invalid_argument naming the first token id outside the
  /// vocabulary (or the separator id).
  void check_tokens(std::span<const token_t> tokens, const char* what) const;

 private:
  struct Slot;
  struct Scratch;
  /// What one draft() call brings besides the requests: candidates of external sources (the
  /// caller's, the recent outputs') and per-request factors; each may be null.
  struct CallInputs {
    const ExternalTrees* external = nullptr;
    const ExternalTrees* recent = nullptr;
    const SourceFactors* factors = nullptr;
  };
  /// The recent outputs' proposals for a call, held as the merge's external input of their tag.
  struct RecentInput {
    RecentDrafts drafts;
    std::vector<token_t> tokens;
    std::vector<uint8_t> tags;
    ExternalTrees trees() const { return {drafts.offsets, tokens, drafts.parents, drafts.weights, {}, tags}; }
  };
  /// Asks the store for every request's context as its trie holds it.
  RecentInput ask_recent(const RecentQuery& recent, std::span<const uint64_t> ids,
                         std::span<const RequestTrie* const> tries) const;
  static Scratch& thread_scratch();
  /// Request b's nodes of `external` into its slot's tree of their tag (`used`: tags seen so far).
  static void stage_external(const ExternalTrees& external, size_t b, Scratch& s, Slot& slot, bool* used);
  void draft_group(const DrafterParams& p, const RequestTrie* const* tries, const int32_t* budgets,
                   const CallInputs& in, size_t begin, size_t end, Scratch& scratch, DraftTree* out) const;
  /// Request b's trees but the datastore's (whose place, slot.trees[0], stays empty).
  void collect(const DrafterParams& p, const RequestTrie& trie, int budget, const CallInputs& in, size_t b,
               Scratch& scratch, Slot& slot) const;
  static void add_copy(const DrafterParams& p, const CopyIndex& copy, std::span<const token_t> context,
                       Scratch& scratch, Slot& slot);
  std::unique_ptr<RequestTrie> make_trie() const;

  std::shared_ptr<const Datastore> datastore_;
  DrafterParams params_;
  std::atomic<int> threads_;
  mutable std::atomic<uint64_t> drafted_{0}, skipped_{0};  // datastore_queries()
  mutable std::shared_mutex mu_;
  std::unordered_map<uint64_t, std::unique_ptr<RequestTrie>> requests_;
};

}  // namespace sssd
