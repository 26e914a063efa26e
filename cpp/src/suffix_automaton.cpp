#include "sssd/suffix_automaton.h"

#include <algorithm>

#include "sssd/check.h"

namespace sssd {

SuffixAutomaton::SuffixAutomaton(size_t max_tokens) : max_tokens_(max_tokens) {
  State root{0, kNone, kNone, {}};
  std::fill(std::begin(root.ends), std::end(root.ends), kNone);
  states_.push_back(root);
}

void SuffixAutomaton::record(State& s, uint32_t pos) {
  if (s.ends[0] == pos) return;
  for (int i = kKeep - 1; i > 0; --i) s.ends[i] = s.ends[i - 1];
  s.ends[0] = pos;
}

uint32_t SuffixAutomaton::edge(uint32_t from, token_t token) const {
  // A state with one transition is checked in place; the index holds the
  // transitions of states with two or more (most states have one).
  const uint32_t first = states_[from].first_edge;
  if (first == kNone) return kNoNode;
  if (edges_[first].next == kNone) return edges_[first].token == token ? first : kNoNode;
  return index_.find(from, token);
}

void SuffixAutomaton::add_edge(uint32_t from, token_t token, uint32_t target) {
  const uint32_t e = uint32_t(edges_.size());
  const uint32_t first = states_[from].first_edge;
  edges_.push_back({token, target, first});
  states_[from].first_edge = e;
  if (first == kNone) return;
  if (edges_[first].next == kNone) index_.insert(from, edges_[first].token, first);  // now two
  index_.insert(from, token, e);
}

void SuffixAutomaton::extend(token_t token) {
  if (capped_) return;
  // Ids stay below kNone: at most 2 states and 3 edges per token.
  if (n_ >= max_tokens_ || n_ >= (size_t(kNone) - 8) / 3) {
    capped_ = true;
    return;
  }
  const uint32_t pos = uint32_t(n_++);
  const uint32_t cur = uint32_t(states_.size());
  State fresh{states_[last_].len + 1, 0, kNone, {}};
  std::fill(std::begin(fresh.ends), std::end(fresh.ends), kNone);
  states_.push_back(fresh);
  uint32_t p = last_;
  uint32_t e = kNoNode;
  while (p != kNone && (e = edge(p, token)) == kNoNode) {
    add_edge(p, token, cur);
    p = states_[p].link;
  }
  if (p != kNone) {
    const uint32_t q = edges_[e].target;
    if (states_[p].len + 1 == states_[q].len) {
      states_[cur].link = q;
    } else {
      // Clone q for its strings of length <= len(p) + 1: q's transitions and
      // end positions (q's occurrences end its shorter suffixes too).
      const uint32_t clone = uint32_t(states_.size());
      State c = states_[q];
      c.len = states_[p].len + 1;
      c.first_edge = kNone;
      states_.push_back(c);
      for (uint32_t f = states_[q].first_edge; f != kNone; f = edges_[f].next) {
        add_edge(clone, edges_[f].token, edges_[f].target);
      }
      for (; p != kNone; p = states_[p].link) {
        const uint32_t f = edge(p, token);
        if (edges_[f].target != q) break;
        edges_[f].target = clone;
      }
      states_[q].link = clone;
      states_[cur].link = clone;
    }
  }
  last_ = cur;
  // Position `pos` ends every suffix on cur's link path: the first kTrack record it.
  uint32_t v = cur;
  for (int k = 0; k < kTrack && v != 0 && v != kNone; ++k, v = states_[v].link) record(states_[v], pos);
}

SuffixAutomaton::Repeat SuffixAutomaton::longest_repeat() const {
  Repeat r;
  if (capped_ || n_ == 0) return r;
  const uint32_t v = states_[last_].link;
  if (v == kNone || v == 0) return r;
  r.length = states_[v].len;
  const uint32_t now = uint32_t(n_ - 1);
  for (int i = 0; i < kKeep; ++i) {
    const uint32_t end = states_[v].ends[i];
    if (end != kNone && end != now) r.ends[r.count++] = end;
  }
  if (r.count == 0) r.length = 0;  // (cannot happen: v's end positions hold an earlier one)
  return r;
}

std::string SuffixAutomaton::check_integrity() const {
  for (size_t s = 1; s < states_.size(); ++s) {
    const State& st = states_[s];
    if (st.link >= states_.size()) return detail::concat("state ", s, " links out of range");
    if (states_[st.link].len >= st.len) return detail::concat("state ", s, " links to a state no shorter");
    for (int i = 0; i < kKeep; ++i) {
      if (st.ends[i] != kNone && st.ends[i] >= n_) return detail::concat("state ", s, " ends past the text");
      if (i > 0 && st.ends[i] != kNone && st.ends[i] >= st.ends[i - 1]) {
        return detail::concat("state ", s, " keeps its end positions out of order");
      }
    }
  }
  size_t indexed = 0;
  for (size_t s = 0; s < states_.size(); ++s) {
    const State& st = states_[s];
    if (st.first_edge != kNone && st.first_edge >= edges_.size()) return detail::concat("state ", s, " has an edge out of range");
    const bool several = st.first_edge != kNone && edges_[st.first_edge].next != kNone;
    for (uint32_t e = st.first_edge; e != kNone; e = edges_[e].next) {
      if (e >= edges_.size() || edges_[e].target >= states_.size()) {
        return detail::concat("state ", s, " has an edge out of range");
      }
      // Only the transitions of a state with two or more are indexed (see edge()).
      if (index_.find(uint32_t(s), edges_[e].token) != (several ? e : kNoNode)) {
        return detail::concat("state ", s, " edge index disagrees");
      }
      indexed += several;
      if (states_[edges_[e].target].len < st.len + 1) return detail::concat("state ", s, " has a shortening edge");
    }
  }
  if (index_.size() != indexed) return "edge index size does not match the branching states' edges";
  return "";
}

}  // namespace sssd
