// Karmarkar-Karp largest differencing for num_ranks-way partitioning (the baseline verl uses).
//
// A state is a partial partition into num_ranks subsets. Repeatedly take the two states with
// the largest spread (max - min subset sum), pair the first's subsets in descending order with
// the second's in ascending order, and merge. Only non-empty subsets are stored: empty ones are
// implicit and sort first, which keeps a merge O(non-empty subsets) instead of O(num_ranks).
//
// A merge is linear except where both states have a subset at the same position: the positions
// where only one does keep that state's order, so only the paired part is sorted, then the three
// sorted runs are merged. Singletons are read from one array and merged states reuse the
// buffers of the states they consumed, so merging allocates nothing in steady state.
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
    int64_t key;         // smallest item index in the subset
    int64_t head, tail;  // linked list of items through `next`
    bool operator<(const Subset& o) const { return std::tie(sum, key) < std::tie(o.sum, o.key); }
};

struct View {
    const Subset* data;
    int64_t size;
};

double spread(View s, int64_t num_ranks) {
    const double low = s.size < num_ranks ? 0.0 : s.data[0].sum;
    return s.data[s.size - 1].sum - low;
}

}  // namespace

void karmarkar_karp(const double* w, int64_t n, int64_t num_ranks, bool equal_counts,
                    int64_t* dst) {
    if (n == 0) return;
    const int64_t d = num_ranks;
    // Equal counts: deal items, longest first, in chunks of d (fillers of weight 0 and
    // index >= n complete the last chunk), so every subset gets one item per chunk.
    const int64_t total = equal_counts ? (n + d - 1) / d * d : n;
    std::vector<int64_t> next(static_cast<size_t>(total), -1);

    // States 0..first-1 are the initial ones, each initial_size subsets of one item at offset
    // id * initial_size of `initial`; later states own a buffer in `merged`.
    const int64_t initial_size = equal_counts ? d : 1, first = total / initial_size;
    std::vector<Subset> initial(static_cast<size_t>(total));
    if (equal_counts) {
        std::vector<int64_t> order(static_cast<size_t>(total));
        order_desc(w, n, order.data());
        for (int64_t i = n; i < total; ++i) order[i] = i;  // fillers: weight 0, last
        for (int64_t k = 0; k < total; ++k) {
            const int64_t i = order[k];
            initial[k] = {i < n ? w[i] : 0.0, i, i, i};
        }
        for (int64_t c = 0; c < first; ++c)
            std::sort(initial.begin() + c * d, initial.begin() + (c + 1) * d);
    } else {
        for (int64_t i = 0; i < n; ++i) initial[i] = {w[i], i, i, i};
    }
    std::vector<std::vector<Subset>> merged;  // state first + k is merged[k]
    std::vector<std::vector<Subset>> spare;   // buffers of consumed states, for reuse
    const auto view = [&](int64_t id) -> View {
        if (id < first) return {initial.data() + id * initial_size, initial_size};
        const auto& s = merged[id - first];
        return {s.data(), static_cast<int64_t>(s.size())};
    };
    const auto release = [&](int64_t id) {
        if (id < first) return;
        spare.push_back(std::move(merged[id - first]));
        merged[id - first] = {};
    };

    using Entry = std::pair<double, int64_t>;  // (-spread, id): smallest pops first
    std::vector<Entry> heap;
    heap.reserve(static_cast<size_t>(first));
    for (int64_t id = 0; id < first; ++id) heap.emplace_back(-spread(view(id), d), id);
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue(
        std::greater<Entry>(), std::move(heap));

    std::vector<Subset> paired, front;  // scratch, reused by every merge
    paired.reserve(static_cast<size_t>(d));
    front.reserve(static_cast<size_t>(d));
    while (queue.size() > 1) {
        const int64_t ia = queue.top().second;
        queue.pop();
        const int64_t ib = queue.top().second;
        queue.pop();
        const View a = view(ia), b = view(ib);
        // Position p pairs a's p-th largest with b's p-th smallest (b's d - kb empties first):
        // a alone for p < d - kb, both for d - kb <= p < ka, b alone for p >= ka.
        const int64_t alone_a = std::min(a.size, d - b.size);
        const int64_t both = std::max<int64_t>(0, a.size + b.size - d);
        paired.resize(static_cast<size_t>(both));
        for (int64_t t = 0; t < both; ++t) {
            const Subset& x = a.data[a.size - 1 - alone_a - t];
            const Subset& y = b.data[t];
            next[x.tail] = y.head;
            paired[t] = {x.sum + y.sum, std::min(x.key, y.key), x.head, y.tail};
        }
        std::sort(paired.begin(), paired.end());
        std::vector<Subset> out;
        if (!spare.empty()) {
            out = std::move(spare.back());
            spare.pop_back();
        }
        out.resize(static_cast<size_t>(alone_a + both + (b.size - both)));
        // Three ascending runs: a's largest alone_a, the pairs, b's largest b.size - both.
        const Subset* a_run = a.data + (a.size - alone_a);
        front.resize(static_cast<size_t>(alone_a + both));
        std::merge(a_run, a_run + alone_a, paired.begin(), paired.end(), front.begin());
        std::merge(front.begin(), front.end(), b.data + both, b.data + b.size, out.begin());
        release(ia);
        release(ib);
        const int64_t id = first + static_cast<int64_t>(merged.size());
        merged.push_back(std::move(out));
        queue.emplace(-spread(view(id), d), id);
    }
    // Final state: subset at ascending position p (empties first) goes to rank p.
    const View last = view(queue.top().second);
    const int64_t offset = d - last.size;
    for (int64_t p = 0; p < last.size; ++p)
        for (int64_t i = last.data[p].head; i != -1; i = next[i])
            if (i < n) dst[i] = offset + p;
}

}  // namespace orch
