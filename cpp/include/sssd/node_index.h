// NodeIndex: (parent node, token) -> child node, for the request trie.
//
// Open addressing with linear probing over one flat array of 16-byte slots,
// power-of-two capacity, grown at 1/2 load. Keys are never erased (a trie only
// grows until its request ends), so there are no tombstones. This keeps child
// lookup O(1) even at the trie root, whose fan-out is the vocabulary.
#pragma once

#include <cstdint>
#include <vector>

#include "sssd/tree_node.h"
#include "sssd/types.h"

namespace sssd {

class NodeIndex {
 public:
  NodeIndex() { slots_.resize(16); }

  /// Child of `parent` with `token`, or kNoNode.
  uint32_t find(uint32_t parent, token_t token) const {
    const uint64_t key = pack(parent, token);
    for (size_t i = hash(key) & mask();; i = (i + 1) & mask()) {
      const Slot& s = slots_[i];
      if (s.value == kNoNode) return kNoNode;
      if (s.key == key) return s.value;
    }
  }

  /// Records child `child` of `parent` with `token` (must be absent).
  void insert(uint32_t parent, token_t token, uint32_t child) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    place(pack(parent, token), child);
    ++size_;
  }

  size_t size() const { return size_; }
  size_t memory_bytes() const { return slots_.capacity() * sizeof(Slot); }

 private:
  struct Slot {
    uint64_t key = 0;
    uint32_t value = kNoNode;  // kNoNode marks an empty slot
  };
  static uint64_t pack(uint32_t parent, token_t token) { return (uint64_t(parent) << 32) | token; }
  static size_t hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return size_t(k);
  }
  size_t mask() const { return slots_.size() - 1; }
  void place(uint64_t key, uint32_t value) {
    size_t i = hash(key) & mask();
    while (slots_[i].value != kNoNode) i = (i + 1) & mask();
    slots_[i] = {key, value};
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const Slot& s : old) {
      if (s.value != kNoNode) place(s.key, s.value);
    }
  }

  std::vector<Slot> slots_;
  size_t size_ = 0;
};

}  // namespace sssd
