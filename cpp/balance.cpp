// Greedy and bound-search post-balancing algorithms (see balance.hpp for the contracts).
// Float expressions must round exactly like the Python reference: no fused multiply-add.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "balance.hpp"

#include <algorithm>
#include <functional>
#include <numeric>
#include <set>
#include <utility>
#include <vector>

namespace orch {
namespace {

using Slot = std::pair<double, int64_t>;  // (load, rank): the smaller pair is the better rank

// Item indices by key, descending (or ascending), ties by index ascending.
template <typename T>
std::vector<int64_t> order_by(const T* key, int64_t n, bool descending) {
    std::vector<std::pair<T, int64_t>> tagged(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) tagged[i] = {descending ? -key[i] : key[i], i};
    std::sort(tagged.begin(), tagged.end());
    std::vector<int64_t> order(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) order[i] = tagged[i].second;
    return order;
}

// Min-heap of (load, rank) over ranks that still have room; assigns `order[from:]` greedily.
void fill_least_loaded(const double* w, const std::vector<int64_t>& order, size_t from,
                       std::vector<double>& load, std::vector<int64_t>& count, int64_t cap,
                       int64_t* dst) {
    std::vector<Slot> heap;
    for (int64_t r = 0; r < static_cast<int64_t>(load.size()); ++r)
        if (count[r] < cap) heap.emplace_back(load[r], r);
    const auto cmp = std::greater<Slot>();
    std::make_heap(heap.begin(), heap.end(), cmp);
    for (size_t k = from; k < order.size(); ++k) {
        const int64_t i = order[k];
        std::pop_heap(heap.begin(), heap.end(), cmp);
        const int64_t r = heap.back().second;
        dst[i] = r;
        load[r] += w[i];
        if (++count[r] < cap) {
            heap.back().first = load[r];
            std::push_heap(heap.begin(), heap.end(), cmp);
        } else {
            heap.pop_back();
        }
    }
}

// GetLeastBatches: cut the ascending order into maximal runs whose cost stays within `bound`.
// cost(b, l) is the cost of a batch of b items whose longest is l (monotone in both).
// Writes batch ids into dst when given; returns the number of batches.
template <typename Cost, typename Bound>
int64_t least_batches(const int64_t* len, const std::vector<int64_t>& asc, int64_t cap,
                      Bound bound, Cost cost, int64_t* dst) {
    int64_t batches = 0, count = 0;
    for (const int64_t i : asc) {
        if (batches == 0 || count >= cap || cost(count + 1, len[i]) > bound) {
            ++batches;
            count = 0;
        }
        ++count;
        if (dst != nullptr) dst[i] = batches - 1;
    }
    return batches;
}

}  // namespace

void lpt(const double* w, int64_t n, int64_t num_ranks, int64_t cap, int64_t* dst) {
    const auto order = order_by(w, n, true);
    std::vector<double> load(static_cast<size_t>(num_ranks), 0.0);
    std::vector<int64_t> count(static_cast<size_t>(num_ranks), 0);
    fill_least_loaded(w, order, 0, load, count, cap, dst);
}

void greedy_tolerance(const int64_t* len, int64_t n, int64_t num_ranks, double tolerance,
                      int64_t cap, int64_t* dst) {
    const auto order = order_by(len, n, true);
    std::vector<double> sum(static_cast<size_t>(num_ranks), 0.0);
    std::vector<double> sq(static_cast<size_t>(num_ranks), 0.0);
    std::vector<int64_t> count(static_cast<size_t>(num_ranks), 0);
    std::set<Slot> open;  // (sum, rank) of ranks with room
    for (int64_t r = 0; r < num_ranks; ++r) open.emplace(0.0, r);
    for (const int64_t i : order) {
        // The smallest sum sets the window; inside it the smallest sum of squares wins,
        // then the smaller sum, then the lower rank.
        const double lowest = open.begin()->first;
        int64_t best = open.begin()->second;
        for (auto it = std::next(open.begin()); it != open.end(); ++it) {
            if (it->first - lowest > tolerance) break;
            const int64_t r = it->second;
            if (sq[r] < sq[best] || (sq[r] == sq[best] && sum[r] < sum[best])) best = r;
        }
        open.erase({sum[best], best});
        const double l = static_cast<double>(len[i]);
        dst[i] = best;
        sum[best] += l;
        sq[best] += l * l;
        if (++count[best] < cap) open.emplace(sum[best], best);
    }
}

void binary_search(const int64_t* len, int64_t n, int64_t num_ranks, int64_t cap, int64_t* dst) {
    if (n == 0) return;
    const auto asc = order_by(len, n, false);
    const auto cost = [](int64_t b, int64_t l) { return b * l; };
    const int64_t longest = len[asc.back()];
    // Bounds: a batch holding the longest item costs at least `longest`; ceil(n/d) items per
    // batch always fit in ceil(n/d)*longest. (The paper's bounds use the shortest length.)
    int64_t left = longest;
    int64_t right = longest * ((n + num_ranks - 1) / num_ranks);
    while (left < right) {
        const int64_t mid = left + (right - left) / 2;
        if (least_batches(len, asc, cap, mid, cost, nullptr) <= num_ranks)
            right = mid;
        else
            left = mid + 1;
    }
    least_batches(len, asc, cap, left, cost, dst);
}

void padded_cost(const int64_t* len, int64_t n, int64_t num_ranks, double alpha, double beta,
                 double c, double multiplier, int64_t cap, int64_t* dst) {
    if (n == 0) return;
    const auto asc = order_by(len, n, false);
    const auto cost = [=](int64_t b, int64_t l) {
        const double bd = static_cast<double>(b), ld = static_cast<double>(l);
        return multiplier * (alpha * bd * ld + beta * bd * ld * ld + c);
    };
    const int64_t longest = len[asc.back()];
    double lo = cost(1, longest);
    double hi = cost((n + num_ranks - 1) / num_ranks, longest);
    if (least_batches(len, asc, cap, lo, cost, nullptr) <= num_ranks) {
        hi = lo;
    } else {
        // Invariant: lo infeasible, hi feasible; stop when no double lies strictly between.
        for (;;) {
            const double mid = lo + (hi - lo) / 2;
            if (!(mid > lo && mid < hi)) break;
            if (least_batches(len, asc, cap, mid, cost, nullptr) <= num_ranks)
                hi = mid;
            else
                lo = mid;
        }
    }
    least_batches(len, asc, cap, hi, cost, dst);
}

void conv(const int64_t* len, int64_t n, int64_t num_ranks, int64_t cap, int64_t* dst) {
    if (n == 0) return;
    // b: the objective Alg. 1 reaches on these lengths (its largest batch sum).
    std::vector<double> w(len, len + n);
    std::vector<int64_t> tmp(static_cast<size_t>(n));
    lpt(w.data(), n, num_ranks, cap, tmp.data());
    std::vector<double> load(static_cast<size_t>(num_ranks), 0.0);
    for (int64_t i = 0; i < n; ++i) load[tmp[i]] += w[i];
    const double bound = *std::max_element(load.begin(), load.end());
    std::fill(load.begin(), load.end(), 0.0);

    // Phase 1: longest first, a batch grows while its padded size (count * its first, longest
    // item) stays within the bound; a new batch opens until num_ranks are open.
    const auto order = order_by(len, n, true);
    std::vector<int64_t> count(static_cast<size_t>(num_ranks), 0);
    int64_t cur = 0;
    size_t k = 0;
    double first = 0.0;
    for (; k < order.size(); ++k) {
        const int64_t i = order[k];
        if (count[cur] > 0 && (count[cur] >= cap || (count[cur] + 1) * first > bound)) {
            if (cur + 1 >= num_ranks) break;
            ++cur;
        }
        if (count[cur] == 0) first = w[i];
        dst[i] = cur;
        load[cur] += w[i];
        ++count[cur];
    }
    // Phase 2: the remaining (shortest) items to the smallest sum of lengths.
    fill_least_loaded(w.data(), order, k, load, count, cap, dst);
}

}  // namespace orch
