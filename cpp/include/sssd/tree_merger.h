// TreeMerger: Algorithm 1 of the paper. One priority queue over the nodes of
// every source tree; priority = the ScoreTable's discount (and calibration
// curve) applied to the source probability. The best candidate is inserted under its draft parent (or
// merged with an identical sibling, which costs no budget), then its children
// in its source tree become candidates. Stops when the draft holds `budget`
// nodes. Ties are broken by (depth, source tree, token, parent), so the
// result is deterministic.
//
// An expanded node's children are sorted by priority once and enter the
// queue one at a time (the next when the previous is popped). The pop order
// is the same as pushing them all, but the queue stays small.
//
// A TreeMerger holds scratch buffers only; use one per thread.
#pragma once

#include <limits>
#include <span>
#include <vector>

#include "sssd/draft_tree.h"
#include "sssd/score_table.h"
#include "sssd/tree_node.h"

namespace sssd {

class TreeMerger {
 public:
  /// Merges `trees` into `out` (cleared first), at most `budget` nodes.
  void merge(std::span<const SourceTree> trees, const ScoreTable& table, int budget, DraftTree& out) {
    start(budget > 0 ? trees : std::span<const SourceTree>{}, table, out);  // budget 0: expand nothing
    run(trees, table, budget, out);
  }

  // A merge in steps, for a source that is costly to ask (the datastore): merge the others while
  // their best candidate beats anything it could offer (`floor`, its priorities' bound), and ask
  // it only if the budget is not full by then. A tree added later whose every priority is <=
  // floor cannot be inserted before a candidate above floor, so start + run(floor) + add + run
  // inserts exactly what merge with the tree from the start does, in the same order. The tree's
  // slot in `trees` must be there from the start (its index breaks ties), empty until added.

  /// Starts a merge of `trees` into `out` (cleared first): their roots' children become candidates.
  void start(std::span<const SourceTree> trees, const ScoreTable& table, DraftTree& out);
  /// Adds trees[index], empty when the merge started, to it.
  void add(std::span<const SourceTree> trees, uint32_t index, const ScoreTable& table);
  /// Inserts candidates best first until `out` holds `budget` nodes, none is left, or the best
  /// left has priority <= floor.
  void run(std::span<const SourceTree> trees, const ScoreTable& table, int budget, DraftTree& out,
           double floor = -std::numeric_limits<double>::infinity());

 private:
  // A source node waiting in a sorted sibling list.
  struct Sibling {
    double priority;
    double prob;   // weight / total
    uint32_t node;
    token_t token;
  };
  struct Candidate {
    double priority;
    uint32_t sibling;  // index into siblings_ of this candidate
    uint32_t end;      // end of its sibling list in siblings_
    uint32_t tree;     // index into trees
    int32_t parent;    // draft node to insert under (-1: root)
    int32_t depth;     // depth of the node once inserted
    token_t token;
  };
  struct Worse {
    bool operator()(const Candidate& a, const Candidate& b) const {
      if (a.priority != b.priority) return a.priority < b.priority;
      if (a.depth != b.depth) return a.depth > b.depth;
      if (a.tree != b.tree) return a.tree > b.tree;
      if (a.token != b.token) return a.token > b.token;
      return a.parent > b.parent;
    }
  };
  void expand(const SourceTree& t, uint32_t tree_index, uint32_t node, int32_t draft_parent,
              int32_t depth, const ScoreTable& table);
  void push(uint32_t sibling, uint32_t end, uint32_t tree, int32_t parent, int32_t depth);

  std::vector<Candidate> heap_;
  std::vector<Sibling> siblings_;   // sorted sibling lists, appended per expansion
  std::vector<int32_t> first_child_, next_sibling_;  // draft tree child lists
  int32_t root_first_child_ = -1;
};

}  // namespace sssd
