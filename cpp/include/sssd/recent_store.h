// RecentStore: the other requests' recent tokens, and drafts from them (the
// "recent" source, sssd/recent_outputs.py).
//
// Requests that run side by side, or one after another, often say the same
// things. The store keeps the latest tokens every request wrote (its output,
// and the last `max_match` tokens of its prompt) in one ring of `capacity`
// tokens, and drafts for a request what followed the longest recent
// occurrence of its context's suffix in the *other* requests' tokens.
//
// The ring: positions are absolute write counts (position a lives in slot
// a % capacity); links hold position + 1 (0: none). Requests write
// interleaved, so each position links to its request's previous and next
// position. A position whose request wrote a token just before it (still in
// the ring) is indexed under the hash of those two tokens, in hash chains as
// in zlib: `head` holds the newest position of each bucket, a position's
// `chain` the one before it in its bucket. A link is alive while the ring
// still holds its position (link > written - capacity) and it was written
// after the last clear (link > floor); chains only go back
// in time, so a walk stops at the first dead link. Forward links never
// outlive their targets (a position's `next` is reset when its slot is
// written again), so following them needs no age check. One quirk is kept
// from the reference: when a request's previous token is exactly `capacity`
// writes old (in the slot being written), the new token becomes its own
// `next` until the request writes again; no draft reaches it (nothing else
// links to it, and its own match ends a token in, at the overwritten one).
//
// Drafting one request (its context's last `max_match` tokens, newest
// first): walk the chain of the context's last two tokens (newest first, at
// most `max_chain` positions); an occurrence is eligible if another request
// wrote it, that request went on after it (next > 0), and its match with the
// context, measured backwards through its request's own tokens, is at least
// `min_match` long. The eligible occurrences with the longest match (at most
// `max_matches`, newest first) are followed for
// reach = min(budget, clamp(int(best * depth_per_match), kMinDepth, depth))
// tokens, and their paths merged into a trie: a node's weight is the share
// of its parent's occurrences that continue with it (at the first level, of
// the chosen occurrences), the first level damped by
// match_damping ^ (max_match - best) for matches shorter than `max_match`.
// Nodes come out by depth, then by (parent, token); parents precede children.
// A batch is drafted in phases (chain steps, match steps, depths), each for
// all requests in lockstep, the next linked position of each prefetched
// before the others are read: the store is larger than the caches and its
// links random, so the misses overlap instead of queueing.
//
// This is the numpy implementation of tests/reference.py
// (RecentOutputsReference), operation for operation: the same hash, the same
// buckets, the same chain positions examined, hence the same drafts.
//
// Thread-safe: one mutex around the store.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "sssd/types.h"

namespace sssd {

/// Drafts for a batch of requests, as CSR: request r's nodes are [offsets[r], offsets[r + 1]).
struct RecentDrafts {
  std::vector<int64_t> offsets;  ///< [R + 1]
  std::vector<int64_t> tokens;
  std::vector<int32_t> parents;  ///< request-local node index, -1: a child of the root
  std::vector<float> weights;    ///< in [0, 1]
};

class RecentStore {
 public:
  /// Deepest follow for any match, however short (unless `depth` or the budget is smaller).
  static constexpr int64_t kMinDepth = 16;
  /// Deepest follow allowed (the largest draft budget, sssd::kMaxBudget).
  static constexpr int64_t kMaxDepth = 4096;

  /// capacity: tokens held (>= 2); max_match / min_match: longest suffix matched, shortest that
  /// drafts (2 <= min_match <= max_match); max_matches: occurrences merged per draft; depth:
  /// tokens followed after each, at most (<= kMaxDepth); max_chain: chain positions examined per request;
  /// depth_per_match: tokens followed per token of the longest match (>= 0); match_damping:
  /// the first level's factor per token a match falls short of max_match (in [0, 1]).
  /// Memory: sizeof(Slot) (40) bytes per token of capacity plus 8 per bucket (the next power of
  /// two >= capacity), zero pages until written.
  RecentStore(int64_t capacity, int64_t max_match, int64_t min_match, int64_t max_matches, int64_t depth,
              int64_t max_chain, double depth_per_match, double match_damping);

  /// Starts (or restarts) a request: stores the last `max_match` tokens of `prompt`, unlinked from
  /// anything the request wrote before.
  void open(uint64_t request_id, std::span<const token_t> prompt);
  /// Appends tokens to the request's stream (a request never opened starts one).
  void extend(uint64_t request_id, std::span<const token_t> tokens);
  /// Appends tokens to many requests under one lock: request ids[b] gets
  /// tokens[offsets[b] .. offsets[b+1]), in order. The offsets are checked before any request changes.
  void extend_batch(std::span<const uint64_t> ids, std::span<const int64_t> offsets, std::span<const token_t> tokens);
  /// Forgets the request's place; its tokens stay (for the others) until the ring overwrites them.
  void close(uint64_t request_id);
  /// Forgets every token written so far and every request's place (a fresh store, its memory
  /// kept): what a benchmark replaying the same prompts calls between runs.
  void clear();

  /// Drafts for R requests: ids [R]; queries [R * max_match], row r the last tokens of request r's
  /// context, newest first, -1 past its start; budgets [R] (>= 0): the most tokens a path holds.
  RecentDrafts propose(std::span<const uint64_t> ids, std::span<const int64_t> queries,
                       std::span<const int64_t> budgets) const;

  /// The request's tokens still held, oldest first (its links walked back from its last token).
  std::vector<token_t> history(uint64_t request_id) const;

  /// Tokens held (since the last clear); tokens ever written.
  uint64_t size() const;
  uint64_t written() const;
  uint64_t capacity() const { return capacity_; }
  int64_t max_match() const { return max_match_; }
  size_t memory_bytes() const { return capacity_ * sizeof(Slot) + buckets_ * sizeof(uint64_t); }

  /// The hash (before masking) of the token pair (a, b). Equal to the Python's int64 arithmetic
  /// for ids below 2^31 (no overflow there); wraps modulo 2^64 above.
  static uint64_t hash(uint64_t a, uint64_t b) {
    const uint64_t x = a * 0x9E3779B1ull + b;
    return x ^ (x >> 29);
  }

 private:
  struct Slot {
    uint64_t owner;  ///< the request that wrote it
    uint64_t prev;   ///< the same request's previous position + 1 (0: none)
    uint64_t next;   ///< the same request's next position + 1 (0: none yet)
    uint64_t chain;  ///< the previous position + 1 in the same bucket (0: none)
    token_t token;
  };
  /// calloc'ed arrays: the kernel's zero pages, touched (and paid for) as the ring fills.
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };

  bool alive(uint64_t link) const { return link > floor_ && link + capacity_ > written_; }
  Slot& at(uint64_t link) { return slots_[(link - 1) % capacity_]; }
  const Slot& at(uint64_t link) const { return slots_[(link - 1) % capacity_]; }
  /// Asks for the slot of a link (both of its cache lines) ahead of its use.
  void prefetch(uint64_t link) const {
    if (link == 0) return;
    const char* p = reinterpret_cast<const char*>(&slots_[(link - 1) % capacity_]);
    __builtin_prefetch(p);
    __builtin_prefetch(p + sizeof(Slot) - 1);
  }
  void append(uint64_t request_id, std::span<const token_t> tokens);
  /// Appends one request's trie to `out`: its occurrences' paths (`stride` tokens each,
  /// kSeparator past a path's end), merged; `best` is their match length.
  void trie(std::span<const token_t> paths, size_t stride, int64_t best, RecentDrafts& out) const;

  uint64_t capacity_, buckets_;
  int64_t max_match_, min_match_, max_matches_, depth_, max_chain_;
  double depth_per_match_, match_damping_;
  std::unique_ptr<Slot[], Free> slots_;
  std::unique_ptr<uint64_t[], Free> head_;
  uint64_t written_ = 0;
  uint64_t floor_ = 0;  ///< links at or below it are dead (clear)
  std::unordered_map<uint64_t, uint64_t> last_;  // request id -> its last position + 1
  mutable std::mutex mu_;
};

}  // namespace sssd
