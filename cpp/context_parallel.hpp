// Context parallelism in the balance: an item too costly for one rank (or whose split lowers
// the slowest rank) is cut into k <= group_size pieces on k ranks of one group of consecutive
// ranks, and the other items are balanced around the pieces (context_parallel.cpp).
#pragma once

#include <cstdint>
#include <vector>

namespace orch {

// A packed cost model: an item of l tokens costs multiplier*(alpha*l + beta*l*l), a rank with
// any work multiplier*const more. A piece of t tokens of an item of l tokens cut in k pieces
// costs multiplier*(alpha*t + beta*l*l/k): load-balanced causal chunking (the item in 2k
// chunks, piece j holding chunks j and 2k-1-j) evens the quadratic attention term out.
struct PackedCost {
    double alpha, beta, constant, multiplier;
    double item(double l) const { return multiplier * (alpha * l + beta * l * l); }
    double piece(double l, double t, double k) const {
        return multiplier * (alpha * t + beta * l * l / k);
    }
    double fixed() const { return multiplier * constant; }
};

struct CpPlan {
    std::vector<int64_t> dst;  // rank per item, -1 for a split item
    std::vector<double> loads;  // per rank, const included for a rank with work
    // One row per token range of a piece, ordered by item then start; a piece is one or two
    // ranges (its front and back chunks, merged when adjacent).
    std::vector<int64_t> item, rank, start, end;
    bool feasible = false;  // every rank within the budget
    bool split = false;  // a split candidate won (else the whole-item portfolio)
    double lower_bound = 0.0;  // no split plan's busiest rank is lighter (pieces of <= N)
};

// Plans lengths[0..n) on num_ranks ranks in groups of group_size consecutive ranks
// (group_size divides num_ranks) under `budget` (a rank's load, const included; +inf: none).
// `node` (ranks per node, 0: unknown): when it is smaller than a group (and tiles it), an item
// in at most `node` pieces goes on the ranks of one node, inside the K/V gather's fast links.
// Candidates, the lightest busiest rank within the budget winning, ties to the earlier: the
// whole-item portfolio lpt(max_steps) when every item fits whole (it stands when it reaches
// lower_bound); split plans at the thresholds t, t/2, t/4 and t/8 of t = max(mean load,
// costliest item / N), each item above the threshold cut into ceil(cost/threshold) pieces,
// more where a piece would exceed the budget, at most min(N, length): a finer threshold
// tightens LPT's bound (mean + the heaviest piece or whole item) and wins only where it lowers
// the busiest rank (the gather's traffic is left out of this model; the simulator counts it).
// Only while no candidate fits the budget, every item of >= N tokens in N pieces. A split
// plan places the pieces first (heaviest first, each item on the k lightest ranks of the
// group whose busiest of those would be lightest, ties to the lower group; the heavier
// pieces, one token more, on the lighter ranks), then the whole items by
// LPT (heaviest first to the least-loaded rank, ties to the lower rank). With every item in
// N pieces and the groups' ranks balanced within a token, that last candidate's busiest rank
// is at most mean + the heaviest piece or whole item + one token's cost + const (LPT's bound
// over groups, then over ranks), so the budget is met whenever it allows that much.
// Deterministic; ties between equal items break by index (equal costs: the longer first),
// so a shuffled input gets the same loads and, item for item, the same pieces' tokens.
CpPlan context_parallel(const int64_t* lengths, int64_t n, int64_t num_ranks, int64_t group_size,
                        int64_t node, const PackedCost& cost, double budget, int64_t max_steps);

}  // namespace orch
