// The exact smallest makespan of additive weights on identical ranks under an item cap: a
// depth-first branch and bound over the items, heaviest first, bounded by a count of search
// nodes, never a clock, so every rank that plans reaches the same answer.
#pragma once

#include <cstdint>
#include <vector>

namespace orch {

// No plan is lighter than this: the mean load, the heaviest item, and for every k >= 1 the
// k + 1 lightest of the k*d + 1 heaviest items (k + 1 of them share a rank); with integer
// weights rounded up to a multiple of `unit` (their greatest common divisor, else 0).
// `x`: m weights sorted descending; `total`: their sum in order (weight_unit's).
double makespan_floor(const double* x, int64_t m, int64_t d, double unit, double total);

// The greatest common divisor of the weights when all are non-negative integers below 2^53
// (the step every load moves by), else 0; and (when given) `total`, their sum in order, from
// the same pass (lpt needs both of a million weights: one pass saves one).
double weight_unit(const double* x, int64_t m, double* total = nullptr);

// weight_unit of weights known whole and below 2^53 (lengths), sorted: a gcd per run of equal
// weights, and none once the divisor is 1 (most lengths: within the first runs).
double length_unit(const double* x, int64_t m);

struct ExactOutcome {
    bool proven;    // no plan under the cap has a lighter busiest rank
    int64_t nodes;  // search nodes visited
};

// Improves `plan` (rank per sorted position, a plan that meets the cap) to the lightest plan
// under the cap, searching at most `node_limit` nodes. `x`: m weights sorted descending;
// `floor`: a lower bound (makespan_floor). Up to 64 integer weights: bin completion on the
// capacity (the floor, then bisection) within a small probe, then pairs of ranks and chains of
// three rebalanced exactly by subset-sum bitsets (they find the plans at the floor that many
// items per rank hide from bin completion), then bin completion again; what is left of the
// budget goes to the item search. The item search (fractional weights, and the rest): ranks
// are tried least loaded first, ties by index, ranks in the same (load, count) state as one
// tried are skipped; a plan replaces the one kept only when strictly lighter. Bitset work
// counts as nodes (items * words / 64). Deterministic.
ExactOutcome improve_exact(const double* x, int64_t m, int64_t d, int64_t cap, double floor,
                           int64_t node_limit, int64_t* plan);

}  // namespace orch
