// RecentStore: a hand-computed draft (damping, shares), a request never drafting from its own
// tokens, the ring forgetting, clear, bad arguments, concurrent writers, and the shape of drafts from
// random interleaved writes with a wrapping ring (tests/test_recent_outputs.py compares the
// drafts themselves with the numpy implementation).
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "sssd/recent_store.h"

using sssd::RecentDrafts;
using sssd::RecentStore;
using sssd::token_t;

namespace {

// Request 0's context, newest first, padded with -1 to max_match.
std::vector<int64_t> query(std::vector<int64_t> context, size_t max_match) {
  std::vector<int64_t> q(max_match, -1);
  for (size_t j = 0; j < max_match && j < context.size(); ++j) q[j] = context[context.size() - 1 - j];
  return q;
}

// {path of tokens: weight} of request r's draft.
std::map<std::vector<int64_t>, float> paths(const RecentDrafts& d, size_t r) {
  std::map<std::vector<int64_t>, float> out;
  std::vector<std::vector<int64_t>> at;
  for (int64_t i = d.offsets[r]; i < d.offsets[r + 1]; ++i) {
    const int32_t p = d.parents[size_t(i)];
    at.push_back(p >= 0 ? at[size_t(p)] : std::vector<int64_t>{});
    at.back().push_back(d.tokens[size_t(i)]);
    out[at.back()] = d.weights[size_t(i)];
  }
  return out;
}

RecentDrafts propose_one(const RecentStore& s, uint64_t id, const std::vector<int64_t>& context, int64_t budget) {
  const std::vector<uint64_t> ids{id};
  const std::vector<int64_t> q = query(context, size_t(s.max_match())), b{budget};
  return s.propose(ids, q, b);
}

}  // namespace

TEST(RecentStore, DampsShortMatchesAndWeighsShares) {
  RecentStore s(100, 4, 2, 16, 64, 64, 8.0, 0.8);
  const std::vector<token_t> out{0, 5, 6, 7, 8, 5, 6, 9};
  s.extend(1, out);
  const auto d = propose_one(s, 2, {3, 5, 6}, 8);  // "5 6" twice: then 7 or 9
  const std::map<std::vector<int64_t>, float> want{
      {{7}, 0.5f * 0.64f}, {{7, 8}, 1.0f}, {{7, 8, 5}, 1.0f}, {{7, 8, 5, 6}, 1.0f}, {{7, 8, 5, 6, 9}, 1.0f},
      {{9}, 0.5f * 0.64f}};
  const auto got = paths(d, 0);
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [path, w] : want) EXPECT_NEAR(got.at(path), w, 1e-6) << path.size();
  EXPECT_EQ(d.tokens.front(), 7);  // by depth, then by token
}

TEST(RecentStore, NeverDraftsFromTheRequestsOwnTokens) {
  RecentStore s(100, 8, 2, 16, 64, 64, 8.0, 0.8);
  s.open(1, std::vector<token_t>{1, 2, 3});
  s.extend(1, std::vector<token_t>{1, 2, 3, 1, 2, 3});
  EXPECT_TRUE(propose_one(s, 1, {1, 2, 3, 1, 2}, 8).tokens.empty());
  s.close(1);
  const auto d = propose_one(s, 2, {7, 1, 2}, 8);
  ASSERT_FALSE(d.tokens.empty());
  EXPECT_EQ(d.tokens[0], 3);
  EXPECT_EQ(propose_one(s, 2, {7, 1, 2}, 0).tokens.size(), 0u);  // budget 0
  EXPECT_EQ(propose_one(s, 2, {7, 1, 2}, 1).tokens.size(), 1u);  // one token per path
}

TEST(RecentStore, ClearForgetsEverythingWrittenBefore) {
  RecentStore s(100, 8, 2, 16, 64, 64, 8.0, 0.8);
  s.extend(1, std::vector<token_t>{1, 2, 3, 4});
  ASSERT_FALSE(propose_one(s, 2, {1, 2}, 8).tokens.empty());
  s.clear();
  EXPECT_EQ(s.size(), 0u);
  EXPECT_EQ(s.written(), 4u);
  EXPECT_TRUE(propose_one(s, 2, {1, 2}, 8).tokens.empty());
  EXPECT_TRUE(s.history(1).empty());
  s.extend(1, std::vector<token_t>{5});  // request 1 starts afresh: 4 -> 5 is not a pair
  s.extend(1, std::vector<token_t>{1, 2, 6});
  const auto d = propose_one(s, 2, {1, 2}, 8);
  ASSERT_EQ(d.tokens.size(), 1u);
  EXPECT_EQ(d.tokens[0], 6);
  EXPECT_EQ(s.history(1), (std::vector<token_t>{5, 1, 2, 6}));
  EXPECT_EQ(s.size(), 4u);
}

TEST(RecentStore, TheRingForgetsTheOldest) {
  RecentStore s(8, 4, 2, 16, 64, 64, 8.0, 0.8);
  s.extend(1, std::vector<token_t>{1, 2, 3});
  EXPECT_EQ(propose_one(s, 2, {1, 2}, 8).tokens.size(), 1u);
  s.extend(3, std::vector<token_t>{9, 9, 9, 9, 9, 9});  // 9 tokens written: the first is gone
  EXPECT_TRUE(propose_one(s, 2, {1, 2}, 8).tokens.empty());
  EXPECT_EQ(s.size(), 8u);
  EXPECT_EQ(s.written(), 9u);
  EXPECT_EQ(s.history(1), (std::vector<token_t>{2, 3}));
}

TEST(RecentStore, RefusesBadArguments) {
  EXPECT_THROW(RecentStore(1, 8, 2, 16, 64, 64, 8.0, 0.8), std::invalid_argument);
  EXPECT_THROW(RecentStore(16, 8, 1, 16, 64, 64, 8.0, 0.8), std::invalid_argument);
  EXPECT_THROW(RecentStore(16, 4, 5, 16, 64, 64, 8.0, 0.8), std::invalid_argument);
  EXPECT_THROW(RecentStore(16, 8, 2, 0, 64, 64, 8.0, 0.8), std::invalid_argument);
  EXPECT_THROW(RecentStore(16, 8, 2, 16, 0, 64, 8.0, 0.8), std::invalid_argument);
  EXPECT_THROW(RecentStore(16, 8, 2, 16, 64, 0, 8.0, 0.8), std::invalid_argument);
  EXPECT_THROW(RecentStore(16, 8, 2, 16, 64, 64, -1.0, 0.8), std::invalid_argument);
  EXPECT_THROW(RecentStore(16, 8, 2, 16, 64, 64, 8.0, 1.5), std::invalid_argument);
  RecentStore s(16, 2, 2, 16, 64, 64, 8.0, 0.8);
  const std::vector<uint64_t> ids{1};
  EXPECT_THROW(s.propose(ids, std::vector<int64_t>{1, 2}, std::vector<int64_t>{-1}), std::invalid_argument);
  EXPECT_THROW(s.propose(ids, std::vector<int64_t>{1}, std::vector<int64_t>{4}), std::invalid_argument);
  EXPECT_THROW(s.propose(ids, std::vector<int64_t>{1, -2}, std::vector<int64_t>{4}), std::invalid_argument);
  EXPECT_THROW(s.propose(ids, std::vector<int64_t>{1, 2}, std::vector<int64_t>{}), std::invalid_argument);
}

TEST(RecentStore, ConcurrentWritersKeepEachRequestInOrder) {
  RecentStore s(1 << 12, 8, 2, 16, 64, 64, 8.0, 0.8);
  std::vector<std::thread> threads;
  for (uint64_t rid = 0; rid < 4; ++rid) {
    threads.emplace_back([&s, rid] {
      s.open(rid, std::vector<token_t>{token_t(rid)});
      for (token_t i = 0; i < 200; ++i) {
        s.extend(rid, std::vector<token_t>{token_t(rid), 1000 + i});
        propose_one(s, rid, {int64_t(rid), 1000 + i}, 8);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(s.size(), 4u * 401);
  for (uint64_t rid = 0; rid < 4; ++rid) {
    std::vector<token_t> want{token_t(rid)};
    for (token_t i = 0; i < 200; ++i) want.insert(want.end(), {token_t(rid), 1000 + i});
    EXPECT_EQ(s.history(rid), want);
  }
}

TEST(RecentStore, RandomWritesGiveWellFormedDrafts) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t capacity = 2 + int64_t(rng() % 80), max_match = 2 + int64_t(rng() % 6);
    const int64_t max_matches = 1 + int64_t(rng() % 5), depth = 1 + int64_t(rng() % 40);
    RecentStore s(capacity, max_match, 2, max_matches, depth, 1 + int64_t(rng() % 20), 0.5 * (rng() % 20), 0.8);
    std::map<uint64_t, std::vector<int64_t>> contexts;
    const token_t vocab = 2 + token_t(rng() % 5);
    for (int step = 0; step < 100; ++step) {
      const uint64_t rid = rng() % 6;
      std::vector<token_t> add(rng() % 5);
      for (auto& t : add) t = token_t(rng() % vocab);
      if (!contexts.count(rid) || rng() % 10 == 0) {
        s.open(rid, add);
        contexts[rid].assign(add.begin(), add.end());
      } else {
        s.extend(rid, add);
        contexts[rid].insert(contexts[rid].end(), add.begin(), add.end());
      }
      std::vector<uint64_t> ids;
      std::vector<int64_t> q, budgets;
      for (const auto& [r, c] : contexts) {
        ids.push_back(r);
        const auto qr = query(c, size_t(max_match));
        q.insert(q.end(), qr.begin(), qr.end());
        budgets.push_back(int64_t(rng() % 70));
      }
      const RecentDrafts d = s.propose(ids, q, budgets);
      ASSERT_EQ(d.offsets.size(), ids.size() + 1);
      ASSERT_EQ(size_t(d.offsets.back()), d.tokens.size());
      ASSERT_EQ(d.parents.size(), d.tokens.size());
      ASSERT_EQ(d.weights.size(), d.tokens.size());
      for (size_t r = 0; r < ids.size(); ++r) {
        std::set<std::pair<int32_t, int64_t>> siblings;
        std::vector<int64_t> node_depth;
        double first_level = 0;
        for (int64_t i = d.offsets[r]; i < d.offsets[r + 1]; ++i) {
          const size_t k = size_t(i - d.offsets[r]);
          const int32_t p = d.parents[size_t(i)];
          ASSERT_TRUE(p >= -1 && p < int32_t(k));
          ASSERT_TRUE(siblings.insert({p, d.tokens[size_t(i)]}).second) << "siblings hold distinct tokens";
          ASSERT_GE(d.weights[size_t(i)], 0.0f);
          ASSERT_LE(d.weights[size_t(i)], 1.0f);
          ASSERT_LT(d.tokens[size_t(i)], int64_t(vocab));
          node_depth.push_back(p < 0 ? 1 : node_depth[size_t(p)] + 1);
          ASSERT_LE(node_depth.back(), std::min(budgets[r], depth));
          if (p < 0) first_level += d.weights[size_t(i)];
        }
        ASSERT_LE(first_level, 1.0 + 1e-6);
      }
    }
    ASSERT_LE(s.size(), uint64_t(capacity));
  }
}
