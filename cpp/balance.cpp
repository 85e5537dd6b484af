// Greedy and bound-search post-balancing algorithms (see balance.hpp for the contracts).
// Float expressions must round exactly like the Python reference: no fused multiply-add.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "balance.hpp"

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <set>
#include <utility>
#include <vector>

namespace orch {
namespace {

using Slot = std::pair<double, int64_t>;  // (load, rank): the smaller pair is the better rank

// Order-preserving map of a double to uint64 (-0.0 counts as +0.0, like Python's comparison).
uint64_t sortable(double x) {
    x += 0.0;
    uint64_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return (bits >> 63) ? ~bits : bits | (uint64_t{1} << 63);
}
uint64_t sortable(int64_t x) { return static_cast<uint64_t>(x) ^ (uint64_t{1} << 63); }

// Item indices by key, descending (or ascending), ties by index ascending: a stable LSD radix
// sort over the bits that vary between keys (integer lengths below 4096 need one pass).
template <typename T>
std::vector<int64_t> order_by(const T* key, int64_t n, bool descending) {
    struct Tagged {
        uint64_t key;
        int64_t index;
    };
    std::vector<Tagged> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
    uint64_t all_and = ~uint64_t{0}, all_or = 0;
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t k = descending ? ~sortable(key[i]) : sortable(key[i]);
        a[i] = {k, i};
        all_and &= k;
        all_or |= k;
    }
    // Sort only the bits that vary, in as few passes of at most 12 bits as cover them.
    const uint64_t varying = all_and ^ all_or;
    if (varying != 0) {
        int low = 0, high = 63;
        while (!((varying >> low) & 1)) ++low;
        while (!((varying >> high) & 1)) --high;
        const int width = high - low + 1, passes = (width + 11) / 12;
        const int bits = (width + passes - 1) / passes;
        const uint64_t mask = (uint64_t{1} << bits) - 1;
        std::vector<size_t> start(size_t{1} << bits);
        for (int shift = low; shift <= high; shift += bits) {
            std::fill(start.begin(), start.end(), 0);
            for (const auto& t : a) ++start[(t.key >> shift) & mask];
            size_t sum = 0;
            for (auto& s : start) sum += std::exchange(s, sum);
            for (const auto& t : a) b[start[(t.key >> shift) & mask]++] = t;
            a.swap(b);
        }
    }
    std::vector<int64_t> order(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) order[i] = a[i].index;
    return order;
}

// Least-loaded open rank, ties to the lowest rank. Loads sit in groups of kGroup ranks, each
// with its minimum; a query scans the group minima, then the winning group, both front to back
// so the first minimum is the lowest rank. Scans are short, independent and branch-light,
// which beats a heap's dependent chain of unpredictable compares. Full ranks hold +inf.
class LeastLoaded {
  public:
    LeastLoaded(const std::vector<double>& load, const std::vector<int64_t>& count, int64_t cap) {
        const size_t d = load.size();
        groups_ = (d + kGroup - 1) / kGroup;
        key_.assign(groups_ * kGroup, kInf);
        for (size_t r = 0; r < d; ++r)
            if (count[r] < cap) key_[r] = load[r];
        group_min_.resize(groups_);
        for (size_t g = 0; g < groups_; ++g) group_min_[g] = min_of(&key_[g * kGroup], kGroup);
        locate();
    }
    int64_t top() const { return static_cast<int64_t>(top_); }
    // The top rank's load became `load`; `full`: it takes no more items.
    void update_top(double load, bool full) {
        key_[top_] = full ? kInf : load;
        const size_t g = top_ / kGroup;
        group_min_[g] = min_of(&key_[g * kGroup], kGroup);
        locate();
    }

  private:
    static constexpr size_t kGroup = 32;
    static constexpr double kInf = std::numeric_limits<double>::infinity();
    static double min_of(const double* x, size_t size) {
        double m[4] = {kInf, kInf, kInf, kInf};  // four independent chains
        size_t i = 0;
        for (; i + 4 <= size; i += 4)
            for (size_t j = 0; j < 4; ++j) m[j] = x[i + j] < m[j] ? x[i + j] : m[j];
        for (; i < size; ++i) m[0] = x[i] < m[0] ? x[i] : m[0];
        return std::min(std::min(m[0], m[1]), std::min(m[2], m[3]));
    }
    static size_t first_equal(const double* x, double value) {
        size_t i = 0;
        while (x[i] != value) ++i;
        return i;
    }
    void locate() {
        const double best = min_of(group_min_.data(), groups_);
        const size_t g = first_equal(group_min_.data(), best);
        top_ = g * kGroup + first_equal(&key_[g * kGroup], best);
    }
    size_t groups_ = 0, top_ = 0;
    std::vector<double> key_, group_min_;
};

// Assigns `order[from:]` greedily to the least-loaded rank that still has room.
void fill_least_loaded(const double* w, const std::vector<int64_t>& order, size_t from,
                       std::vector<double>& load, std::vector<int64_t>& count, int64_t cap,
                       int64_t* dst) {
    LeastLoaded heap(load, count, cap);
    for (size_t k = from; k < order.size(); ++k) {
        const int64_t i = order[k];
        const int64_t r = heap.top();
        dst[i] = r;
        load[r] += w[i];
        heap.update_top(load[r], ++count[r] >= cap);
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
