// Exact fewest weight moved at a makespan limit, for small instances (used by greedy_stay,
// cpp/movement.cpp).
#pragma once

#include <cstdint>
#include <vector>

namespace orch {

// Ranks and items per rank up to which fewest_moved runs (2^items keep-sets per rank).
constexpr int64_t kKeepSearchMaxRanks = 16;
constexpr int64_t kKeepSearchMaxItemsPerRank = 8;

// The plan moving the least weight off its source rank with every rank's load <= limit,
// found by trying, in increasing moved weight, which items each rank keeps, and packing the
// rest into the room left; empty when no plan is found within max_nodes units of work (a
// combination tried costs d, a packing step 1) or the instance is above the sizes above.
// Deterministic: ties break by keep-set and rank.
std::vector<int64_t> fewest_moved(const double* w, const int64_t* src, int64_t n, int64_t d,
                                  double limit, int64_t max_nodes);

// The same optimum by a depth-first search over items, heaviest first (stay, or move to a rank
// with room), bounded by what each rank must still shed and, with integer weights, by the room
// the ranks must leave unused (at most d x limit - total); with ranks_per_node > 0 an item
// moved off its node counts twice (greedy_stay's node-aware movement). The search runs twice
// within max_nodes search nodes each, trying an item's ranks first stay-first, then by the
// bound each choice leaves (the second only where the first did not end within its nodes).
// A plan moving less than `incumbent`, or empty when none is found (or above the sizes above).
std::vector<int64_t> fewest_moved_by_items(const double* w, const int64_t* src, int64_t n,
                                           int64_t d, int64_t ranks_per_node, double limit,
                                           double incumbent, int64_t max_nodes);

}  // namespace orch
