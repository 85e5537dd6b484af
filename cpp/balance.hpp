// Post-balancing algorithms: pure functions over item lengths/weights, no Python, no torch.
//
// Every function writes dst[i] in [0, num_ranks) for every item i (input order) and is
// deterministic: ties between equal items break by item index, ties between equal batches by
// rank index, and floating-point sums are accumulated in one fixed order. `cap` is the maximum
// number of items per rank (pass n for "no cap"); callers guarantee cap * num_ranks >= n.
#pragma once

#include <cstddef>
#include <cstdint>

namespace orch {

// x >= 0 and x == floor(x) (+inf included, NaN not), without floor, which the portable build
// (no SSE4.1) emulates in several instructions: 0.72 ms against 0.94 ms over 983,040 doubles.
// Every double from 2^52 up is whole; below, truncation to int64 is exact for whole numbers only.
inline bool is_whole(double x) {
    return x >= 0x1p52 || (x >= 0.0 && static_cast<double>(static_cast<int64_t>(x)) == x);
}

// The sum of w[0..n) when every entry is a non-negative whole number, else -1: integer loads
// are what lpt's packed tree keys and the item search's waste bound (keep_search.cpp) need.
inline double whole_total(const double* w, int64_t n) {
    double total = 0.0;
    bool whole = true;
    for (int64_t i = 0; i < n; ++i) {
        whole &= is_whole(w[i]);
        total += w[i];
    }
    return whole ? total : -1.0;
}

// Item k to rank k mod num_ranks: LPT's plan when every item weighs the same (the sorted order
// is then the input order, dealt out in rounds of num_ranks).
void deal_in_rounds(int64_t n, int64_t num_ranks, int64_t* dst);

// Item indices by weight descending, ties by index ascending (the radix sort every policy uses).
void order_desc(const double* w, int64_t n, int64_t* order);

// Longest-processing-time: items by weight descending into the least-loaded rank (paper Alg. 1
// when weights are lengths; greedy_cost when they are alpha*l + beta*l^2). Then, when
// max_steps > 0, at most max_steps local-search steps, each the best single move or swap of one
// item between the heaviest and the lightest rank that lowers the heavier of the two below the
// old maximum (stops when none does); never raises the maximum load.
//
// With max_steps > 0 it is a portfolio (the default `greedy`): refined LPT (its local search
// stops at the floor, exact.hpp's makespan_floor); then, while the plan is above the floor,
// the exact branch and bound (exact.hpp) on at most kExactItems items within kExactNodes
// search nodes; then Karmarkar-Karp (items * num_ranks <= kPortfolioKkWork; above that its
// equal-counts variant, items <= kPortfolioKkEqualItems) and MULTIFIT
// (items <= kPortfolioMultifitItems, at most kMultifitRounds bisection rounds of first-fit
// decreasing between the floor and the plan in hand), each refined the same way; the lightest
// maximum load wins, ties to the earlier candidate. Without a binding cap (cap >= n) every
// step after LPT plans only the items of non-zero weight, and the limits count those alone:
// zero-length items change no load and stay where LPT put them. All items equal: item k of
// the sorted order goes to rank k mod num_ranks, LPT's own plan, at once. `proven` (when
// given): the plan reached the floor or the exact search finished, so no plan is lighter.
// refine() tries every partner rank, not only the lightest, up to this many ranks.
constexpr int64_t kWideRanks = 1024;
constexpr size_t kWidePartners = 32;
constexpr int64_t kPortfolioKkWork = int64_t{1} << 20;
constexpr int64_t kPortfolioKkEqualItems = int64_t{1} << 13;
constexpr int64_t kPortfolioMultifitItems = int64_t{1} << 13;
constexpr int kMultifitRounds = 24;
constexpr int64_t kExactItems = 64;
constexpr int64_t kExactNodes = int64_t{1} << 17;
// `exact` = false leaves the exact search and the wider partners out (greedy_stay's reference
// makespan on small instances, movement.cpp). `loads` (when given): each rank's load under the
// plan, written when the refined LPT plan stands and its loads are integer sums below 2^53
// (exact, so equal to numpy's bincount in input order): returns whether it wrote them.
bool lpt(const double* w, int64_t n, int64_t num_ranks, int64_t cap, int64_t* dst,
         int64_t max_steps = 0, bool* proven = nullptr, bool exact = true,
         double* loads = nullptr);
// The same on non-negative lengths below 2^53 (each exact as a double, so the same plan), sorted
// on their integer bits, fewer than a double's, without a converted copy.
bool lpt(const int64_t* lengths, int64_t n, int64_t num_ranks, int64_t cap, int64_t* dst,
         int64_t max_steps, bool* proven, double* loads);

// Paper Alg. 4: like lpt on lengths, but among ranks whose sum is within `tolerance` of the
// smallest sum, the one with the smallest sum of squares wins. O(n log d): a treap over the
// ranks keyed by sum answers "best rank within the window" in one walk down.
void greedy_tolerance(const int64_t* len, int64_t n, int64_t num_ranks, double tolerance,
                      int64_t cap, int64_t* dst);

// Paper Alg. 2: binary search on the bound of count*max(l) with the ascending greedy
// GetLeastBatches check; batch k of the result goes to rank k (trailing ranks may be empty).
void binary_search(const int64_t* len, int64_t n, int64_t num_ranks, int64_t cap, int64_t* dst);

// Beyond the paper: the same contiguous-in-sorted-order search, on the full padded cost
// multiplier*(alpha*b*max + beta*b*max^2 + c) of a batch (bisection on a real bound).
void padded_cost(const int64_t* len, int64_t n, int64_t num_ranks, double alpha, double beta,
                 double c, double multiplier, int64_t cap, int64_t* dst);

// Paper Alg. 5 (ConvTransformer): open up to num_ranks batches of similar lengths, longest
// first, each holding at most b padded tokens where b is Alg. 1's max batch sum; the rest go
// to the batch with the smallest sum of lengths.
void conv(const int64_t* len, int64_t n, int64_t num_ranks, int64_t cap, int64_t* dst);

// Karmarkar-Karp largest differencing into num_ranks subsets. equal_counts: items are dealt in
// chunks of num_ranks (zero-length fillers), so counts differ by at most one.
void karmarkar_karp(const double* w, int64_t n, int64_t num_ranks, bool equal_counts,
                    int64_t* dst);

}  // namespace orch
