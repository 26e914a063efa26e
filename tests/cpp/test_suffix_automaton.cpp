// SuffixAutomaton and CopyIndex against brute force: the longest repeated suffix after every
// token, its end positions, the overlapping copy and a remembered edit.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "sssd/copy_index.h"
#include "sssd/suffix_automaton.h"

using sssd::CopyIndex;
using sssd::SuffixAutomaton;
using sssd::token_t;

namespace {

// The longest suffix of t that also ends earlier, and all its earlier ends.
std::pair<uint32_t, std::vector<uint32_t>> brute_repeat(const std::vector<token_t>& t) {
  const size_t n = t.size();
  for (size_t len = n - 1; len >= 1; --len) {
    std::vector<uint32_t> ends;
    for (size_t e = len - 1; e + 1 < n; ++e) {
      bool same = true;
      for (size_t k = 0; k < len && same; ++k) same = t[e - k] == t[n - 1 - k];
      if (same) ends.push_back(uint32_t(e));
    }
    if (!ends.empty()) return {uint32_t(len), ends};
  }
  return {0, {}};
}

}  // namespace

TEST(SuffixAutomaton, LongestRepeatEqualsBruteForce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int vocab = 1 + int(rng() % 4), n = 1 + int(rng() % 60);
    SuffixAutomaton a;
    std::vector<token_t> t;
    for (int i = 0; i < n; ++i) {
      t.push_back(token_t(rng() % vocab));
      a.extend(t.back());
      const auto r = a.longest_repeat();
      const auto [len, ends] = brute_repeat(t);
      ASSERT_EQ(r.length, len);
      for (int k = 0; k < r.count; ++k) {
        ASSERT_NE(std::find(ends.begin(), ends.end(), r.ends[k]), ends.end());
        if (k) {
          ASSERT_LT(r.ends[k], r.ends[k - 1]);
        }
      }
      ASSERT_EQ(r.count == 0, len == 0);
    }
    ASSERT_EQ(a.check_integrity(), "");
  }
}

TEST(SuffixAutomaton, CappedStopsGrowing) {
  SuffixAutomaton a(10);
  for (token_t i = 0; i < 20; ++i) a.extend(i % 3);
  EXPECT_TRUE(a.capped());
  EXPECT_EQ(a.size(), 10u);
  EXPECT_EQ(a.longest_repeat().length, 0u);
}

TEST(CopyIndex, FollowReadsOnIntoAnOverlappingCopy) {
  CopyIndex c(1 << 10, 2, 8);
  std::vector<token_t> text;
  for (int i = 0; i < 6; ++i) {
    const token_t t = token_t(4 + i % 2);  // 4 5 4 5 4 5
    c.append(text, t);
    text.push_back(t);
  }
  std::vector<token_t> out;
  // after the repeat 4 5 4 5 ending at position 3: 4 5, then the copy reads its own output
  c.follow(text, 4, 5, false, out);
  EXPECT_EQ(out, (std::vector<token_t>{4, 5, 4, 5, 4}));
}

TEST(CopyIndex, AnEditIsRememberedAndAppliedAgain) {
  // source: 10 11 12 13 14 15 16 17 42 18 19 20 21 22 23 42 24 25; the copy writes 43 for 42.
  std::vector<token_t> source = {10, 11, 12, 13, 14, 15, 16, 17, 42, 18, 19, 20, 21, 22, 23, 42, 24, 25};
  std::vector<token_t> text = source;
  text.push_back(99);
  CopyIndex c(1 << 10, 4, 8);
  std::vector<token_t> built;
  for (const token_t t : text) {
    c.append(built, t);
    built.push_back(t);
  }
  for (const token_t t : std::vector<token_t>{10, 11, 12, 13, 14, 15, 16, 17, 43, 18, 19}) {
    c.append(built, t);
    built.push_back(t);
  }
  ASSERT_FALSE(c.edits().empty());
  EXPECT_EQ(c.edits()[0].removed, std::vector<token_t>{42});
  EXPECT_EQ(c.edits()[0].inserted, std::vector<token_t>{43});
  std::vector<token_t> plain, edited;
  ASSERT_NE(c.follow(built, 11, 8, true, edited), nullptr);  // from source position 11 (20 ...)
  c.follow(built, 11, 8, false, plain);
  EXPECT_EQ(plain, (std::vector<token_t>{20, 21, 22, 23, 42, 24, 25, 99}));
  EXPECT_EQ(edited, (std::vector<token_t>{20, 21, 22, 23, 43, 24, 25, 99}));
}

TEST(CopyIndex, AnEditOfFourOrMoreTokensAppliesWhereOnlyTwoInnerTokensDiffer) {
  // "\n", spaces, two digits, " |": a line number removed; the next line's digits differ.
  const std::vector<token_t> removed = {1, 2, 14, 15, 3};
  const auto at = [&](std::vector<token_t> text) { return CopyIndex::removed_at(removed, text, 1); };
  EXPECT_TRUE(at({9, 1, 2, 14, 15, 3}));   // the same
  EXPECT_TRUE(at({9, 1, 2, 14, 16, 3}));   // one digit changed
  EXPECT_TRUE(at({9, 1, 2, 15, 10, 3}));   // two
  EXPECT_FALSE(at({9, 1, 5, 15, 10, 3}));  // three
  EXPECT_FALSE(at({9, 4, 2, 14, 15, 3}));  // another first token
  EXPECT_FALSE(at({9, 1, 2, 14, 15, 4}));  // another last token
  EXPECT_FALSE(at({9, 1, 2, 14, 15}));     // runs past the text
  const std::vector<token_t> short_removed = {1, 14, 3};  // under four tokens: exact only
  EXPECT_TRUE(CopyIndex::removed_at(short_removed, std::vector<token_t>{1, 14, 3}, 0));
  EXPECT_FALSE(CopyIndex::removed_at(short_removed, std::vector<token_t>{1, 15, 3}, 0));
}

TEST(CopyIndex, WritingARememberedEditMovesTheCursorPastItsSite) {
  // Source lines "1 2 <d> <d> 3 <content>" (newline, spaces, two digits, bar); the copy writes
  // "1 <content>": it follows the newline and deletes "2 <d> <d> 3" before every line.
  const std::vector<std::vector<token_t>> lines = {{100, 101, 102}, {103, 104, 105}, {106, 107, 108}};
  std::vector<token_t> text, built;
  for (size_t k = 0; k < lines.size(); ++k) {
    text.insert(text.end(), {1, 2, 11, token_t(10 + k), 3});
    text.insert(text.end(), lines[k].begin(), lines[k].end());
  }
  text.push_back(7);
  const size_t written_from = text.size();
  for (const auto& line : lines) {
    text.push_back(1);
    text.insert(text.end(), line.begin(), line.end());
  }
  CopyIndex c(1 << 10, 3, 8);
  for (const token_t t : text) {
    c.append(built, t);
    built.push_back(t);
    if (built.size() == written_from + 10) {  // "1 106" written: the second edit's site passed
      ASSERT_TRUE(c.aligned());
      EXPECT_EQ(c.cursor(), 21u);  // 106 in the source (line 3: positions 16-23)
    }
  }
  // the deletion learnt at the second line, counted again (fuzzily) at the third
  const auto& e = c.edits()[0];
  EXPECT_EQ(e.removed, (std::vector<token_t>{2, 11, 11, 3}));
  EXPECT_TRUE(e.inserted.empty());
  EXPECT_EQ(e.applied, 2);
}
