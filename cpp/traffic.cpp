// Where the tokens of a move go, for node-wise placement (orchmllm/placement.py): the sparse
// volume table it assigns over, and the traffic a move causes. O(items) passes, no sorting
// by comparison, so they stay far below the assignment's time at 10^6 items.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "numpy_arrays.hpp"

namespace py = pybind11;

namespace {

using orch::check_range, orch::I64, orch::to_array;

// CSR of the sums of `weight` per (row, col), rows in order, each row's entries by sum
// descending (ties by column; the order capacitated_assignment searches fastest in), zero
// sums left out: one counting sort by row, then each row's sums in a column-indexed scratch
// array (a row has few distinct columns, so sorting them is cheap).
py::tuple grouped_sums(I64 row, I64 col, I64 weight, int64_t num_rows, int64_t num_cols) {
    const int64_t n = weight.size();
    check_range(row, n, num_rows, "grouped_sums: row");
    check_range(col, n, num_cols, "grouped_sums: col");
    // Every sum is at most the weights' total (all >= 0), saturated rather than overflowed:
    // it decides below whether a sum and a column pack into one sort key.
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t x = weight.data()[i];
        if (x < 0) throw std::invalid_argument("grouped_sums: weight < 0");
        total = x > kMax - total ? kMax : total + x;
    }
    // cols and sums are written straight into arrays of the largest size they can reach (one
    // entry per item) and returned as views of their first indptr[num_rows] entries: at 10^6
    // items, vectors copied out at the end cost 4 ms of page faults and copies.
    py::array_t<int64_t> indptr(num_rows + 1), cols_out(n), sums_out(n);
    {
        py::gil_scoped_release release;
        const int64_t *r = row.data(), *c = col.data(), *w = weight.data();
        int64_t *ip = indptr.mutable_data(), *cols = cols_out.mutable_data(),
                *sums = sums_out.mutable_data();
        // (col, weight) pairs in row order, written where they go: reading the items in
        // input order and each row's pairs in a run costs far less than gathering by index.
        // The buffer is kept for the next call on this thread: a fresh one is page-faulted in
        // on every call (7.5 ms instead of 3 ms for the 481,830 pieces of a 16,384-rank step).
        thread_local std::vector<std::pair<int64_t, int64_t>> buffer;
        if (buffer.size() < static_cast<size_t>(n)) buffer.resize(static_cast<size_t>(n));
        std::pair<int64_t, int64_t>* const by_row = buffer.data();  // one thread-local lookup
        std::vector<int64_t> start(num_rows + 1, 0);
        for (int64_t i = 0; i < n; ++i) ++start[r[i] + 1];
        for (int64_t k = 0; k < num_rows; ++k) start[k + 1] += start[k];
        std::vector<int64_t> next(start.begin(), start.end() - 1);
        for (int64_t i = 0; i < n; ++i) by_row[next[r[i]]++] = {c[i], w[i]};
        // A row's order, sum descending then column ascending, is that of one integer key
        // (sum, then the column's complement) when both fit in 64 bits: sorting plain integers
        // costs a fraction of a comparator that reads the sums through the column.
        int col_bits = 1;
        while ((int64_t{1} << col_bits) < num_cols) ++col_bits;
        const bool packed = col_bits < 63 && total < (int64_t{1} << (63 - col_bits));
        const uint64_t col_mask = (uint64_t{1} << col_bits) - 1;
        std::vector<int64_t> acc(num_cols, 0), seen;
        std::vector<uint64_t> keys;
        int64_t edges = 0;
        ip[0] = 0;
        for (int64_t k = 0; k < num_rows; ++k) {
            seen.clear();
            for (int64_t j = start[k]; j < start[k + 1]; ++j) {
                const auto [col_k, w_k] = by_row[j];
                if (acc[col_k] == 0 && w_k != 0) seen.push_back(col_k);
                acc[col_k] += w_k;
            }
            if (packed) {
                keys.clear();
                for (const int64_t col_k : seen)
                    keys.push_back(static_cast<uint64_t>(acc[col_k]) << col_bits |
                                   (col_mask - static_cast<uint64_t>(col_k)));
                std::sort(keys.begin(), keys.end(), std::greater<>());
                for (size_t j = 0; j < keys.size(); ++j)
                    seen[j] = static_cast<int64_t>(col_mask - (keys[j] & col_mask));
            } else {
                std::sort(seen.begin(), seen.end(), [&](int64_t a, int64_t b) {
                    return acc[a] != acc[b] ? acc[a] > acc[b] : a < b;
                });
            }
            for (const int64_t col_k : seen) {
                cols[edges] = col_k;
                sums[edges++] = acc[col_k];
                acc[col_k] = 0;
            }
            ip[k + 1] = edges;
        }
    }
    const py::slice used(0, indptr.data()[num_rows], 1);
    return py::make_tuple(indptr, cols_out[used], sums_out[used]);
}

// Tokens of the move src -> dst: sent and received across nodes per rank, moved inside a
// node, and not moved (rank r lives on node r / ranks_per_node).
py::tuple traffic(I64 lengths, I64 src, I64 dst, int64_t num_ranks, int64_t ranks_per_node) {
    const int64_t n = lengths.size();
    if (ranks_per_node < 1)
        throw py::value_error("traffic: ranks_per_node must be >= 1, got " +
                              std::to_string(ranks_per_node));
    check_range(src, n, num_ranks, "traffic: src");
    check_range(dst, n, num_ranks, "traffic: dst");
    std::vector<int64_t> sent(num_ranks, 0), recv(num_ranks, 0);
    int64_t intra = 0, kept = 0;
    {
        py::gil_scoped_release release;
        const int64_t *l = lengths.data(), *s = src.data(), *t = dst.data();
        std::vector<int64_t> node(num_ranks);  // a lookup costs less than two divisions an item
        for (int64_t r = 0; r < num_ranks; ++r) node[r] = r / ranks_per_node;
        for (int64_t i = 0; i < n; ++i) {
            if (s[i] == t[i]) {
                kept += l[i];
            } else if (node[s[i]] == node[t[i]]) {
                intra += l[i];
            } else {
                sent[s[i]] += l[i];
                recv[t[i]] += l[i];
            }
        }
    }
    return py::make_tuple(to_array(sent), to_array(recv), intra, kept);
}

}  // namespace

void register_traffic(py::module_& m) {
    m.def("grouped_sums", &grouped_sums, py::arg("row"), py::arg("col"), py::arg("weight"),
          py::arg("num_rows"), py::arg("num_cols"),
          "CSR (indptr, cols, sums) of non-negative weight summed per (row, col), each row by "
          "sum descending then column; zero sums left out.");
    m.def("traffic", &traffic, py::arg("lengths"), py::arg("src"), py::arg("dst"),
          py::arg("num_ranks"), py::arg("ranks_per_node"),
          "(inter-node tokens sent per rank, received per rank, intra-node tokens, kept tokens).");
}
