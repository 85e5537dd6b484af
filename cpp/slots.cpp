// Slots of a rearrangement plan (orchmllm/plan.py): where every item sits in its rank's local
// order before and after a move. Two counting passes, O(items + ranks): a stable sort by rank
// by comparison costs far more at 10^6 items, and every step plan builds several of these.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "numpy_arrays.hpp"

namespace py = pybind11;

namespace {

using orch::check_range, orch::I64;

// src_slot: the item's position among the items of its source rank, in global order.
// dst_slot: its position among the items of its destination rank, ordered by (source rank,
// source slot), so a receiver gets its items in the order of the global gather.
py::tuple plan_slots(I64 src, I64 dst, int64_t num_ranks) {
    const int64_t n = src.size();
    if (num_ranks < 1) throw std::invalid_argument("plan_slots: num_ranks < 1");
    check_range(src, n, num_ranks, "plan_slots: src");
    check_range(dst, n, num_ranks, "plan_slots: dst");
    py::array_t<int64_t> src_slot_out(n), dst_slot_out(n);
    {
        py::gil_scoped_release release;
        const int64_t *s = src.data(), *t = dst.data();
        int64_t *src_slot = src_slot_out.mutable_data(), *dst_slot = dst_slot_out.mutable_data();
        std::vector<int64_t> count(num_ranks, 0);
        bool sorted = true;  // sources in gather order (the usual case): no reordering needed
        for (int64_t i = 0; i < n; ++i) {
            src_slot[i] = count[s[i]]++;
            sorted = sorted && (i == 0 || s[i - 1] <= s[i]);
        }
        if (sorted) {
            std::fill(count.begin(), count.end(), 0);
            for (int64_t i = 0; i < n; ++i) dst_slot[i] = count[t[i]]++;
        } else {
            std::vector<int64_t> start(num_ranks + 1, 0), by_src(n);
            for (int64_t r = 0; r < num_ranks; ++r) start[r + 1] = start[r] + count[r];
            for (int64_t i = 0; i < n; ++i) by_src[start[s[i]] + src_slot[i]] = i;
            std::fill(count.begin(), count.end(), 0);
            for (const int64_t i : by_src) dst_slot[i] = count[t[i]]++;
        }
    }
    return py::make_tuple(src_slot_out, dst_slot_out);
}

}  // namespace

void register_slots(py::module_& m) {
    m.def("plan_slots", &plan_slots, py::arg("src"), py::arg("dst"), py::arg("num_ranks"),
          "(src_slot, dst_slot) of the move src -> dst: positions in global order on the source "
          "rank, in (source rank, source slot) order on the destination rank.");
}
