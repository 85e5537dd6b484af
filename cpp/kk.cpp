// Karmarkar-Karp largest differencing for num_ranks-way partitioning (the baseline verl uses).
//
// A state is a partial partition into num_ranks subsets. Repeatedly take the two states with
// the largest spread (max - min subset sum), pair the first's subsets in descending order with
// the second's in ascending order, and merge. Only non-empty subsets are stored: empty ones are
// implicit and sort first, which keeps a merge O(non-empty subsets) instead of O(num_ranks).
//
// Determinism: subsets in a state are ordered by (sum, smallest item index), states in the
// queue by (spread descending, creation id ascending); the Python reference uses the same keys.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <queue>
#include <tuple>
#include <vector>

#include "balance.hpp"

namespace orch {
namespace {

struct Subset {
    double sum;
    int64_t key;  // smallest item index in the subset
    int64_t head, tail;  // linked list of items through `next`
    bool operator<(const Subset& o) const { return std::tie(sum, key) < std::tie(o.sum, o.key); }
};

struct State {
    std::vector<Subset> subsets;  // non-empty only, ascending
};

double spread(const State& s, int64_t num_ranks) {
    const double low = static_cast<int64_t>(s.subsets.size()) < num_ranks ? 0.0
                                                                          : s.subsets.front().sum;
    return s.subsets.back().sum - low;
}

}  // namespace

void karmarkar_karp(const double* w, int64_t n, int64_t num_ranks, bool equal_counts,
                    int64_t* dst) {
    if (n == 0) return;
    const int64_t d = num_ranks;
    // Equal counts: deal items, longest first, in chunks of d (fillers of weight 0 and
    // index >= n complete the last chunk), so every subset gets one item per chunk.
    int64_t total = n;
    if (equal_counts) total = (n + d - 1) / d * d;
    std::vector<double> weight(w, w + n);
    weight.resize(static_cast<size_t>(total), 0.0);
    std::vector<int64_t> next(static_cast<size_t>(total), -1);

    std::vector<State> states;
    if (equal_counts) {
        std::vector<std::pair<double, int64_t>> tagged(static_cast<size_t>(total));
        for (int64_t i = 0; i < total; ++i) tagged[i] = {-weight[i], i};
        std::sort(tagged.begin(), tagged.end());
        for (int64_t c = 0; c < total / d; ++c) {
            State s;
            for (int64_t j = 0; j < d; ++j) {
                const int64_t i = tagged[c * d + j].second;
                s.subsets.push_back({weight[i], i, i, i});
            }
            std::sort(s.subsets.begin(), s.subsets.end());
            states.push_back(std::move(s));
        }
    } else {
        for (int64_t i = 0; i < n; ++i) states.push_back({{{weight[i], i, i, i}}});
    }

    using Entry = std::pair<double, int64_t>;  // (-spread, id): smallest pops first
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue;
    for (int64_t id = 0; id < static_cast<int64_t>(states.size()); ++id)
        queue.emplace(-spread(states[id], d), id);

    std::vector<Subset> merged;
    while (queue.size() > 1) {
        const int64_t ia = queue.top().second;
        queue.pop();
        const int64_t ib = queue.top().second;
        queue.pop();
        auto& a = states[ia].subsets;
        auto& b = states[ib].subsets;
        const int64_t ka = static_cast<int64_t>(a.size()), kb = static_cast<int64_t>(b.size());
        // Position p pairs a's p-th largest with b's p-th smallest (b's empties come first).
        merged.clear();
        for (int64_t p = 0; p < d; ++p) {
            const bool has_a = p < ka, has_b = p >= d - kb;
            if (!has_a && !has_b) {
                p = d - kb - 1;  // skip the run of empty pairs
                continue;
            }
            if (has_a && has_b) {
                const Subset& x = a[ka - 1 - p];
                const Subset& y = b[p - (d - kb)];
                next[x.tail] = y.head;
                merged.push_back({x.sum + y.sum, std::min(x.key, y.key), x.head, y.tail});
            } else {
                merged.push_back(has_a ? a[ka - 1 - p] : b[p - (d - kb)]);
            }
        }
        std::sort(merged.begin(), merged.end());
        State s{merged};
        a.clear();
        a.shrink_to_fit();
        b.clear();
        b.shrink_to_fit();
        const int64_t id = static_cast<int64_t>(states.size());
        queue.emplace(-spread(s, d), id);
        states.push_back(std::move(s));
    }
    // Final state: subset at ascending position p (empties first) goes to rank p.
    const auto& last = states[queue.top().second].subsets;
    const int64_t offset = d - static_cast<int64_t>(last.size());
    for (int64_t p = 0; p < static_cast<int64_t>(last.size()); ++p)
        for (int64_t i = last[p].head; i != -1; i = next[i])
            if (i < n) dst[i] = offset + p;
}

}  // namespace orch
