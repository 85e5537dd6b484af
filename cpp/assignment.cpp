// The assignment behind node-wise placement (orchmllm/placement.py): batches to node
// slots, then batches to ranks inside a node. A pure function over int64 arrays, exact unless
// its search is bounded.
//
// Deterministic: every loop runs in a fixed order, ties break by the smaller index.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

#include "assignment.hpp"
#include "numpy_arrays.hpp"

namespace py = pybind11;

namespace orch {

// Successive shortest augmenting paths (Jonker-Volgenant / Crouse) with integer potentials:
// a virtual "unmatched" column with unlimited capacity and cost 0 bounds every search, and a
// full column is expanded through all rows it holds. Integer profits make the result exact.
AssignmentResult capacitated_assignment(const int64_t* indptr, const int64_t* cols,
                                        const int64_t* profit, int64_t num_rows,
                                        int64_t num_cols, int64_t capacity,
                                        int64_t max_settled) {
    constexpr int64_t kInf = std::numeric_limits<int64_t>::max() / 4;
    const int64_t none = num_cols;  // the virtual unmatched column
    std::vector<int64_t> u(num_rows, 0), v(num_cols + 1, 0);
    std::vector<int64_t> col_of(num_rows, -1);
    std::vector<std::vector<int64_t>> members(num_cols);
    std::vector<int64_t> dist(num_cols + 1, kInf), pred(num_cols + 1, -1);
    std::vector<char> settled(num_cols + 1, 0);
    std::vector<int64_t> touched, scanned, done;
    // Each row's edges by profit descending (ties by column), sorted here unless the caller's
    // already are: a search stops reading a row once no later edge can beat the best column
    // with room found so far (v <= 0, so base - profit bounds an edge's distance below).
    std::vector<int64_t> sorted_cols, sorted_profit;
    const auto in_order = [&](int64_t a, int64_t b) {
        return profit[a] != profit[b] ? profit[a] > profit[b] : cols[a] < cols[b];
    };
    bool is_sorted = true;
    for (int64_t r = 0; r < num_rows && is_sorted; ++r)
        for (int64_t e = indptr[r] + 1; e < indptr[r + 1] && is_sorted; ++e)
            is_sorted = in_order(e - 1, e);
    if (!is_sorted) {
        std::vector<int64_t> idx(indptr[num_rows]);
        for (int64_t e = 0; e < indptr[num_rows]; ++e) idx[e] = e;
        for (int64_t r = 0; r < num_rows; ++r)
            std::sort(idx.begin() + indptr[r], idx.begin() + indptr[r + 1], in_order);
        sorted_cols.resize(idx.size());
        sorted_profit.resize(idx.size());
        for (size_t j = 0; j < idx.size(); ++j) {
            sorted_cols[j] = cols[idx[j]];
            sorted_profit[j] = profit[idx[j]];
        }
        cols = sorted_cols.data();
        profit = sorted_profit.data();
    }

    // Dijkstra frontier: (distance, 0 if the column has room else 1, column); stale entries
    // (settled, or a distance since improved) are skipped when popped. Ties therefore prefer
    // a column with room, then the smaller index.
    using Entry = std::tuple<int64_t, int, int64_t>;
    std::vector<Entry> frontier;
    const auto has_room = [&](int64_t k) {
        return k == none || static_cast<int64_t>(members[k].size()) < capacity;
    };
    // Warm start: a row whose most profitable column (any of them, on a tie: the first with
    // room) still has room takes it, with potentials u = -profit, v = 0. Every reduced cost
    // stays >= 0, matched edges are tight and free columns keep v = 0: the state the search
    // below reaches had it processed these rows first. Only the rest need a search.
    std::vector<int64_t> pending;
    for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t best_profit = indptr[r] < indptr[r + 1] ? profit[indptr[r]] : 0;
        int64_t best = -1;
        for (int64_t e = indptr[r]; e < indptr[r + 1] && best < 0; ++e)
            if (profit[e] == best_profit && has_room(cols[e])) best = cols[e];
        if (best >= 0) {
            col_of[r] = best;
            members[best].push_back(r);
            u[r] = -best_profit;
        } else {
            pending.push_back(r);
        }
    }
    const int64_t budget = max_settled > 0 ? max_settled : num_cols + 1;
    for (const int64_t cur : pending) {
        touched.clear();
        scanned.clear();
        done.clear();
        frontier.clear();
        Entry sink_bound(kInf, 0, none);  // the best column with room reached so far
        int64_t min_val = 0;
        const auto relax = [&](int64_t r) {
            scanned.push_back(r);
            const int64_t base = min_val - u[r];
            const auto visit = [&](int64_t k, int64_t cost) {
                if (settled[k]) return;
                const int64_t d = base + cost - v[k];
                if (d >= dist[k]) return;
                const Entry entry(d, has_room(k) ? 0 : 1, k);
                if (sink_bound < entry) return;  // never popped before sink_bound ends it
                if (std::get<1>(entry) == 0) sink_bound = entry;
                if (dist[k] == kInf) touched.push_back(k);
                dist[k] = d;
                pred[k] = r;
                frontier.push_back(entry);
                std::push_heap(frontier.begin(), frontier.end(), std::greater<Entry>());
            };
            visit(none, 0);
            for (int64_t e = indptr[r]; e < indptr[r + 1]; ++e) {
                if (base - profit[e] > std::get<0>(sink_bound)) break;
                visit(cols[e], -profit[e]);
            }
        };
        relax(cur);
        int64_t sink = -1;
        while (sink < 0 && static_cast<int64_t>(done.size()) < budget) {
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
        if (sink >= 0) {
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
        }  // else: over budget, `cur` stays unmatched and nothing changed
        for (const int64_t k : touched) {
            dist[k] = kInf;
            pred[k] = -1;
            settled[k] = 0;
        }
    }
    // Weak duality with column prices y = -v >= 0: any assignment earns at most
    // sum_r max(0, max_k profit(r, k) - y_k) + capacity * sum_k y_k.
    int64_t bound = 0;
    for (int64_t k = 0; k < num_cols; ++k) bound -= capacity * v[k];
    for (int64_t r = 0; r < num_rows; ++r) {
        int64_t best = 0;
        for (int64_t e = indptr[r]; e < indptr[r + 1]; ++e)
            best = std::max(best, profit[e] + v[cols[e]]);
        bound += best;
    }
    return {std::move(col_of), bound};
}

}  // namespace orch

void register_assignment(py::module_& m) {
    using orch::I64;
    m.def(
        "capacitated_assignment",
        [](I64 indptr, I64 cols, I64 profit, int64_t num_cols, int64_t capacity,
           int64_t max_settled) {
            const int64_t rows = indptr.size() - 1;
            if (rows < 0 || cols.size() != profit.size() ||
                indptr.data()[rows] != static_cast<int64_t>(cols.size()))
                throw std::invalid_argument("capacitated_assignment: malformed CSR arrays");
            if (num_cols < 1 || capacity < 1 || rows > num_cols * capacity)
                throw std::invalid_argument("capacitated_assignment: too few column slots");
            // Path lengths and potentials stay within a few times the total profit: bounding
            // it keeps every int64 sum far from overflow (placement's volumes stay below 2^53).
            constexpr int64_t kMaxTotal = int64_t{1} << 58;
            int64_t total = 0;
            for (py::ssize_t e = 0; e < cols.size(); ++e) {
                const int64_t p = profit.data()[e];
                if (cols.data()[e] < 0 || cols.data()[e] >= num_cols || p <= 0)
                    throw std::invalid_argument(
                        "capacitated_assignment: edge column out of range or profit <= 0");
                if (p > kMaxTotal - total)
                    throw std::invalid_argument(
                        "capacitated_assignment: profits sum above 2^58 (int64 overflow)");
                total += p;
            }
            if (max_settled < 0)
                throw std::invalid_argument("capacitated_assignment: max_settled < 0");
            orch::AssignmentResult out;
            {
                py::gil_scoped_release release;
                out = orch::capacitated_assignment(indptr.data(), cols.data(), profit.data(),
                                                   rows, num_cols, capacity, max_settled);
            }
            return py::make_tuple(orch::to_array(out.col_of), out.bound);
        },
        py::arg("indptr"), py::arg("cols"), py::arg("profit"), py::arg("num_cols"),
        py::arg("capacity"), py::arg("max_settled") = 0,
        "Max-profit assignment of CSR rows to columns of equal capacity: (column per row, -1 = "
        "unmatched; an upper bound on the profit of any assignment). max_settled > 0 bounds "
        "each row's search (0: exact, and the bound equals the profit found).");
}
