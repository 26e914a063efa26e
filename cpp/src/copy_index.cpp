#include "sssd/copy_index.h"

#include <algorithm>

namespace sssd {

CopyIndex::CopyIndex(size_t max_tokens, int min_match, double half_life)
    : sam_(max_tokens), enabled_(max_tokens > 0), min_match_(min_match),
      decay_(half_life > 0 ? std::exp2(-1.0 / half_life) : 0.0) {}

size_t CopyIndex::memory_bytes() const {
  size_t bytes = sam_.memory_bytes() + edits_.capacity() * sizeof(Edit) + pending_.capacity() * sizeof(token_t);
  for (const Edit& e : edits_) bytes += (e.removed.capacity() + e.inserted.capacity()) * sizeof(token_t);
  return bytes;
}

namespace {

// Same length, same first and last tokens, at most kFuzzyMismatch others changed (the fuzzy rule).
bool fuzzy_equal(const token_t* a, const token_t* b, size_t size) {
  if (size < CopyIndex::kFuzzyMin || a[0] != b[0] || a[size - 1] != b[size - 1]) return false;
  size_t changed = 0;
  for (size_t i = 1; i + 1 < size; ++i) {
    if (a[i] != b[i] && ++changed > CopyIndex::kFuzzyMismatch) return false;
  }
  return true;
}

}  // namespace

bool CopyIndex::removed_at(const std::vector<token_t>& removed, std::span<const token_t> text, size_t j) {
  const size_t size = removed.size();
  if (size == 0 || j + size > text.size()) return false;
  const token_t* at = text.data() + j;
  return std::equal(removed.begin(), removed.end(), at) || fuzzy_equal(removed.data(), at, size);
}

bool CopyIndex::at_cursor_site(const Edit& e, std::span<const token_t> text) const {
  return e.removed.empty() ? text[cursor_] == e.anchor : removed_at(e.removed, text, size_t(cursor_) + 1);
}

CopyIndex::Resync CopyIndex::resync(std::span<const token_t> context) const {
  if (enabled_ && via_edit_ && aligned_ && size_t(cursor_) + 1 < context.size()) return {kResyncMax, cursor_};
  return resync_from(context, cursor_);
}

bool CopyIndex::start_edit(std::span<const token_t> text, token_t token) {
  const size_t j = size_t(cursor_) + 1, n = text.size();
  for (const Edit& e : edits_) {
    if (!at_cursor_site(e, text)) continue;
    const size_t resume = j + e.removed.size();  // the source's next token after the site
    if (!e.inserted.empty() && e.inserted[0] == token) {
      pending_.assign(e.inserted.begin() + 1, e.inserted.end());
      pending_pos_ = 0;
      pending_cursor_ = uint32_t(resume - 1);
      if (pending_.empty()) {
        cursor_ = pending_cursor_;
        aligned_ = via_edit_ = true;
      }
      return true;
    }
    if (e.inserted.empty() && resume < n && text[resume] == token) {  // a deletion, then the source again
      cursor_ = uint32_t(resume);
      aligned_ = true;
      return true;
    }
  }
  return false;
}

void CopyIndex::append(std::span<const token_t> text, token_t token) {
  if (!enabled_) return;
  const size_t n = text.size();  // the new token's position
  const SuffixAutomaton::Repeat r = sam_.longest_repeat();
  if (r.length >= uint32_t(min_match_) && r.count > 0) {
    hits_ = decay_ * hits_ + (text[r.ends[0] + 1] == token ? 1.0 : 0.0);
    trials_ = decay_ * trials_ + 1.0;
  }
  if (!pending_.empty()) {  // writing a remembered edit's insertion
    if (token == pending_[pending_pos_]) {
      sam_.extend(token);
      if (++pending_pos_ == pending_.size()) {  // written: the copy reads on after the site
        pending_.clear();
        cursor_ = pending_cursor_;
        aligned_ = via_edit_ = true;
      }
      return;
    }
    pending_.clear();  // the output left the edit too: it diverged at the site
  }
  if (aligned_ && size_t(cursor_) + 1 < n) count_site(text, token);
  const bool follows = aligned_ && size_t(cursor_) + 1 < n && text[cursor_ + 1] == token;
  sam_.extend(token);
  if (follows) {
    ++cursor_;
    return;
  }
  const bool left = aligned_;
  if (aligned_) {  // the output leaves the source here
    aligned_ = via_edit_ = false;
    diverged_at_ = uint32_t(n);
  }
  const SuffixAutomaton::Repeat now = sam_.longest_repeat();
  if (now.length >= uint32_t(min_match_) && now.count > 0) {
    if (cursor_ != kNoCursor) remember(text, token, now.ends[0], now.length);
    cursor_ = now.ends[0];
    aligned_ = true;
    return;
  }
  // No long repeat to go by: does the output write a remembered edit where it left the source?
  if (left && size_t(cursor_) + 1 < n && start_edit(text, token)) return;
  if (cursor_ == kNoCursor) return;
  // Does the output rejoin the source it diverged from? (The context now ends with `token`.)
  token_t tail[kResyncMax];  // the context's last tokens, newest first
  size_t tail_len = 0;
  tail[tail_len++] = token;
  for (size_t i = n; i > 0 && tail_len < kResyncMax; --i) tail[tail_len++] = text[i - 1];
  Resync best;
  const size_t last = std::min(n - 1, size_t(cursor_) + kWindow);  // source positions < n: before the new token
  for (size_t e = cursor_; e <= last && e < n; ++e) {
    uint32_t m = 0;
    while (m < tail_len && m <= e && text[e - m] == tail[m]) ++m;
    if (m > best.length && (m >= 2 || e <= size_t(cursor_) + kNear)) best = {m, uint32_t(e)};
  }
  if (best.length == 0) return;
  remember(text, token, best.end, best.length);
  cursor_ = best.end;
  aligned_ = true;
}

void CopyIndex::remember(std::span<const token_t> text, token_t token, uint32_t source_end, uint32_t matched) {
  // The output from diverged_at_ to the token before the `matched` ones that rejoined replaced the
  // source after the cursor up to the token before the source's matched ones.
  const size_t n = text.size();
  const auto at = [&](size_t i) { return i < n ? text[i] : token; };
  const size_t removed_begin = size_t(cursor_) + 1, removed_end = size_t(source_end) + 1 - matched;
  const size_t inserted_begin = diverged_at_, inserted_end = n + 1 - matched;
  if (removed_end < removed_begin || inserted_end < inserted_begin || inserted_begin > n) return;
  if (removed_end - removed_begin > kEditMax || inserted_end - inserted_begin > kEditMax) return;
  if (removed_end == removed_begin && inserted_end == inserted_begin) return;
  Edit e{text[cursor_], {}, {}};
  for (size_t i = removed_begin; i < removed_end; ++i) e.removed.push_back(text[i]);
  for (size_t i = inserted_begin; i < inserted_end; ++i) e.inserted.push_back(at(i));
  const auto same = std::find_if(edits_.begin(), edits_.end(), [&](const Edit& x) {
    if (x.inserted != e.inserted || x.removed.size() != e.removed.size()) return false;
    if (x.removed.empty()) return x.anchor == e.anchor;
    return x.removed == e.removed || fuzzy_equal(x.removed.data(), e.removed.data(), e.removed.size());
  });
  if (same != edits_.end()) {  // seen again: its site was counted as it was passed (count_site)
    e.applied = same->applied;
    e.skipped = same->skipped;
    edits_.erase(same);
  }
  edits_.insert(edits_.begin(), std::move(e));
  if (edits_.size() > kEdits) edits_.pop_back();
}

CopyIndex::Resync CopyIndex::resync_from(std::span<const token_t> context, uint32_t cursor) const {
  Resync best;
  if (!enabled_ || cursor == kNoCursor || context.size() < 2) return best;
  const size_t n = context.size();
  const size_t last = std::min(n - 2, size_t(cursor) + kWindow);
  for (size_t e = cursor; e <= last; ++e) {
    uint32_t m = 0;
    while (m < kResyncMax && m <= e && context[e - m] == context[n - 1 - m] && e - m != n - 1 - m) ++m;
    if (m > best.length && (m >= 2 || e <= size_t(cursor) + kNear)) best = {m, uint32_t(e)};
  }
  return best;
}

void CopyIndex::count_site(std::span<const token_t> text, token_t token) {
  // The copy is at a site of a remembered edit: did the output edit it again, or copy the source?
  const size_t j = size_t(cursor_) + 1, n = text.size();
  for (Edit& e : edits_) {
    if (!at_cursor_site(e, text)) continue;
    const size_t after = j + e.removed.size();
    const bool edits = e.inserted.empty() ? (after < n && token == text[after] && token != text[j])
                                          : (token == e.inserted[0] && token != text[j]);
    if (edits) {
      e.applied += 1;
    } else if (token == text[j]) {
      e.skipped += 1;
    }
    return;  // the most recent edit of the site speaks for it
  }
}

const CopyIndex::Edit* CopyIndex::follow(std::span<const token_t> context, size_t start, size_t depth, bool edited,
                                         std::vector<token_t>& out) const {
  out.clear();
  const Edit* first = nullptr;
  const size_t n = context.size();
  size_t j = start;
  while (out.size() < depth) {
    if (!edited) {
      out.push_back(j < n ? context[j] : out[j - n]);
      ++j;
      continue;
    }
    if (j >= n) break;
    const Edit* hit = nullptr;
    for (const Edit& e : edits_) {
      const size_t k = e.removed.empty() ? 1 : 0;  // an insertion follows its anchor
      if (e.removed.empty() ? context[j] != e.anchor : !removed_at(e.removed, context, j)) continue;
      if (j + k + e.removed.size() > n) continue;
      hit = &e;
      break;
    }
    if (!hit) {
      out.push_back(context[j++]);
      continue;
    }
    if (!first) first = hit;
    if (hit->removed.empty()) out.push_back(context[j++]);  // the anchor, then the insertion
    for (const token_t t : hit->inserted) {
      if (out.size() >= depth) break;
      out.push_back(t);
    }
    j += hit->removed.size();
  }
  return first;
}

}  // namespace sssd
