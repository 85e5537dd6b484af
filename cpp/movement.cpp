// Where the tokens go: the exact node/rank assignment behind node-wise placement, and the
// movement-aware balancing policy (greedy_stay). Pure functions over int64/float64 arrays.
//
// Both are deterministic: every loop runs in a fixed order, ties break by the smaller index.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <set>
#include <stdexcept>
#include <tuple>
#include <string>
#include <utility>
#include <vector>

#include "balance.hpp"

namespace py = pybind11;

namespace orch {

// Maximum-profit assignment of rows to columns, each column taking at most `capacity` rows,
// over a sparse set of positive-profit edges (CSR: row r has edges indptr[r]..indptr[r+1]).
// A row may also stay unmatched (col -1) at profit 0; because every profit is positive and
// the caller has rows <= num_cols * capacity, any unmatched row can later fill any free slot,
// so this is exactly the dense assignment problem with each column repeated `capacity` times.
//
// Successive shortest augmenting paths (Jonker-Volgenant / Crouse) with integer potentials:
// a virtual "unmatched" column with unlimited capacity and cost 0 bounds every search, and a
// full column is expanded through all rows it holds. Integer profits make the result exact.
std::vector<int64_t> capacitated_assignment(const int64_t* indptr, const int64_t* cols,
                                            const int64_t* profit, int64_t num_rows,
                                            int64_t num_cols, int64_t capacity) {
    constexpr int64_t kInf = std::numeric_limits<int64_t>::max() / 4;
    const int64_t none = num_cols;  // the virtual unmatched column
    std::vector<int64_t> u(num_rows, 0), v(num_cols + 1, 0);
    std::vector<int64_t> col_of(num_rows, -1);
    std::vector<std::vector<int64_t>> members(num_cols);
    std::vector<int64_t> dist(num_cols + 1, kInf), pred(num_cols + 1, -1);
    std::vector<char> settled(num_cols + 1, 0);
    std::vector<int64_t> touched, scanned, done;

    // Dijkstra frontier: (distance, 0 if the column has room else 1, column); stale entries
    // (settled, or a distance since improved) are skipped when popped. Ties therefore prefer
    // a column with room, then the smaller index.
    using Entry = std::tuple<int64_t, int, int64_t>;
    std::vector<Entry> frontier;
    const auto has_room = [&](int64_t k) {
        return k == none || static_cast<int64_t>(members[k].size()) < capacity;
    };
    for (int64_t cur = 0; cur < num_rows; ++cur) {
        touched.clear();
        scanned.clear();
        done.clear();
        frontier.clear();
        int64_t min_val = 0;
        const auto relax = [&](int64_t r) {
            scanned.push_back(r);
            const int64_t base = min_val - u[r];
            const auto visit = [&](int64_t k, int64_t cost) {
                if (settled[k]) return;
                const int64_t d = base + cost - v[k];
                if (d < dist[k]) {
                    if (dist[k] == kInf) touched.push_back(k);
                    dist[k] = d;
                    pred[k] = r;
                    frontier.emplace_back(d, has_room(k) ? 0 : 1, k);
                    std::push_heap(frontier.begin(), frontier.end(), std::greater<Entry>());
                }
            };
            for (int64_t e = indptr[r]; e < indptr[r + 1]; ++e) visit(cols[e], -profit[e]);
            visit(none, 0);
        };
        relax(cur);
        int64_t sink = -1;
        while (sink < 0) {
            std::pop_heap(frontier.begin(), frontier.end(), std::greater<Entry>());
            const auto [d, full, best] = frontier.back();
            frontier.pop_back();
            if (settled[best] || d != dist[best]) continue;
            min_val = d;
            settled[best] = 1;
            done.push_back(best);
            if (!full) {
                sink = best;
            } else {
                for (const int64_t r : members[best]) relax(r);
            }
        }
        // Potentials keep every reduced cost non-negative and the matched edges tight.
        u[cur] += min_val;
        for (const int64_t r : scanned)
            if (r != cur) u[r] += min_val - dist[col_of[r]];
        for (const int64_t k : done) v[k] -= min_val - dist[k];
        // Augment along the path back to `cur`.
        for (int64_t k = sink;;) {
            const int64_t r = pred[k];
            const int64_t old = col_of[r];
            col_of[r] = k == none ? -1 : k;
            if (k != none) members[k].push_back(r);
            if (r == cur) break;
            auto& from = members[old];
            from.erase(std::find(from.begin(), from.end(), r));
            k = old;
        }
        for (const int64_t k : touched) {
            dist[k] = kInf;
            pred[k] = -1;
            settled[k] = 0;
        }
    }
    return col_of;
}

// Movement-aware balancing: items stay on their source rank unless the rank is above a
// makespan target T, starting from T = (1 + tolerance) * LPT makespan. Each rank keeps its
// heaviest items first while they fit under T (so mostly small items are shed, overshooting
// the required shedding by less than one small item); the shed items are then placed
// largest first, best fit: on the fullest rank they still fit on under T, preferring the
// item's own node (ranks_per_node > 0), and on the least-loaded rank if none fits. If the
// result misses (1 + tolerance) * LPT makespan, variants are tried: shed items placed in the
// same pass as the keeps, at their turn in weight order, and lower targets T, which shed more
// and leave more freedom; the variant moving the least weight wins. If all miss, the LPT
// assignment itself is returned, so the tolerance always holds.
std::vector<int64_t> movement_aware(const double* w, const int64_t* src, int64_t n,
                                    int64_t num_ranks, double tolerance,
                                    int64_t ranks_per_node) {
    std::vector<int64_t> greedy(n);
    lpt(w, n, num_ranks, n, greedy.data());
    std::vector<double> greedy_load(num_ranks, 0.0);
    for (int64_t i = 0; i < n; ++i) greedy_load[greedy[i]] += w[i];
    const double makespan = *std::max_element(greedy_load.begin(), greedy_load.end());
    const double limit = (1.0 + tolerance) * makespan;

    std::vector<int64_t> order(n);
    for (int64_t i = 0; i < n; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return w[a] > w[b]; });

    using Slot = std::pair<double, int64_t>;  // (load, rank), ordered by load then rank
    std::vector<int64_t> dst(n), best;
    std::vector<double> load(num_ranks);
    std::set<Slot> slots;  // kept in step with `load` while `live`
    bool live = false;
    double target = limit;
    const auto add = [&](int64_t i, int64_t r) {
        if (live) slots.erase({load[r], r});
        dst[i] = r;
        load[r] += w[i];
        if (live) slots.emplace(load[r], r);
    };
    const auto place = [&](int64_t i) {
        int64_t r = -1;
        if (ranks_per_node > 0) {  // fullest rank of the own node that still fits
            const int64_t first = src[i] / ranks_per_node * ranks_per_node;
            const int64_t last = std::min(first + ranks_per_node, num_ranks);
            for (int64_t q = first; q < last; ++q)
                if (load[q] + w[i] <= target && (r < 0 || load[q] > load[r])) r = q;
        }
        if (r < 0) {  // fullest rank anywhere that still fits, else the least loaded
            auto it = slots.upper_bound({target - w[i], num_ranks});
            r = it == slots.begin() ? slots.begin()->second : std::prev(it)->second;
            if (load[r] + w[i] > target) r = slots.begin()->second;
        }
        add(i, r);
    };
    // Candidates (target scale, interleave): all keeps first, then the shed items (keeps the
    // most), or one pass in weight order with shed items placed at their turn (closer to LPT
    // when items are coarse). The first candidate almost always meets the limit; otherwise
    // the one meeting it with the least weight moved wins (ties: the earlier candidate).
    std::vector<std::pair<double, bool>> candidates = {{1.0, false}, {1.0, true}};
    for (const double scale : {0.995, 0.98, 0.95, 0.9, 0.8, 0.6, 0.3})
        for (const bool interleave : {false, true}) candidates.emplace_back(scale, interleave);
    double best_moved = 0.0;
    for (size_t k = 0; k < candidates.size(); ++k) {
        const auto [scale, interleave] = candidates[k];
        target = scale * limit;
        std::fill(load.begin(), load.end(), 0.0);
        slots.clear();
        live = interleave;
        if (live)
            for (int64_t r = 0; r < num_ranks; ++r) slots.emplace(0.0, r);
        std::vector<int64_t> shed;
        for (const int64_t i : order) {
            if (load[src[i]] + w[i] <= target) {
                add(i, src[i]);
            } else if (interleave) {
                place(i);
            } else {
                shed.push_back(i);
            }
        }
        if (!live) {
            for (int64_t r = 0; r < num_ranks; ++r) slots.emplace(load[r], r);
            live = true;
        }
        for (const int64_t i : shed) place(i);
        if (*std::max_element(load.begin(), load.end()) > limit) continue;
        if (k == 0) return dst;
        double moved = 0.0;
        for (int64_t i = 0; i < n; ++i)
            if (dst[i] != src[i]) moved += w[i];
        if (best.empty() || moved < best_moved) {
            best = dst;
            best_moved = moved;
        }
    }
    if (!best.empty()) return best;
    return greedy;
}

}  // namespace orch

namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using F64 = py::array_t<double, py::array::c_style | py::array::forcecast>;

py::array_t<int64_t> to_array(const std::vector<int64_t>& v) {
    py::array_t<int64_t> out(static_cast<py::ssize_t>(v.size()));
    std::copy(v.begin(), v.end(), out.mutable_data());
    return out;
}

}  // namespace

void register_movement(py::module_& m) {
    m.def(
        "capacitated_assignment",
        [](I64 indptr, I64 cols, I64 profit, int64_t num_cols, int64_t capacity) {
            const int64_t rows = indptr.size() - 1;
            if (rows < 0 || cols.size() != profit.size() ||
                indptr.data()[rows] != static_cast<int64_t>(cols.size()))
                throw std::invalid_argument("capacitated_assignment: malformed CSR arrays");
            if (num_cols < 1 || capacity < 1 || rows > num_cols * capacity)
                throw std::invalid_argument("capacitated_assignment: too few column slots");
            for (py::ssize_t e = 0; e < cols.size(); ++e)
                if (cols.data()[e] < 0 || cols.data()[e] >= num_cols || profit.data()[e] <= 0)
                    throw std::invalid_argument(
                        "capacitated_assignment: edge column out of range or profit <= 0");
            std::vector<int64_t> out;
            {
                py::gil_scoped_release release;
                out = orch::capacitated_assignment(indptr.data(), cols.data(), profit.data(),
                                                   rows, num_cols, capacity);
            }
            return to_array(out);
        },
        py::arg("indptr"), py::arg("cols"), py::arg("profit"), py::arg("num_cols"),
        py::arg("capacity"),
        "Max-profit assignment of CSR rows to columns of equal capacity; -1 = unmatched.");
    m.def(
        "movement_aware",
        [](F64 weights, I64 src, int64_t num_ranks, double tolerance, int64_t ranks_per_node) {
            const int64_t n = weights.size();
            if (src.size() != n) throw std::invalid_argument("movement_aware: size mismatch");
            for (int64_t i = 0; i < n; ++i)
                if (src.data()[i] < 0 || src.data()[i] >= num_ranks)
                    throw std::invalid_argument("movement_aware: src out of range");
            std::vector<int64_t> out;
            {
                py::gil_scoped_release release;
                out = orch::movement_aware(weights.data(), src.data(), n, num_ranks, tolerance,
                                           ranks_per_node);
            }
            return to_array(out);
        },
        py::arg("weights"), py::arg("src"), py::arg("num_ranks"), py::arg("tolerance"),
        py::arg("ranks_per_node") = 0,
        "Balance within (1 + tolerance) of LPT while keeping items on their source rank "
        "(and moved items on their node where they fit; ranks_per_node 0 = ignore nodes).");
}
