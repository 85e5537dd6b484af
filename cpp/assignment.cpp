// The exact assignment behind node-wise placement (orchmllm/placement.py): batches to node
// slots, then batches to ranks inside a node. A pure function over int64 arrays.
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
#include <vector>

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

}  // namespace orch

namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

py::array_t<int64_t> to_array(const std::vector<int64_t>& v) {
    py::array_t<int64_t> out(static_cast<py::ssize_t>(v.size()));
    std::copy(v.begin(), v.end(), out.mutable_data());
    return out;
}

}  // namespace

void register_assignment(py::module_& m) {
    m.def(
        "capacitated_assignment",
        [](I64 indptr, I64 cols, I64 profit, int64_t num_cols, int64_t capacity) {
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
}
