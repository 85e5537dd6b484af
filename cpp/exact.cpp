// The exact smallest makespan of additive weights on identical ranks under an item cap, for
// small instances (orchmllm/exact.py): depth-first branch and bound over the items, heaviest
// first. Bounded by a count of search nodes, never a clock, so every rank reaches the same
// answer; deterministic: ranks are tried in index order, ties keep the first plan found.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "numpy_arrays.hpp"

namespace py = pybind11;

namespace {

class Search {
  public:
    Search(const double* w, int64_t n, int64_t d, int64_t cap, int64_t node_limit)
        : w_(w), n_(n), d_(d), cap_(cap), node_limit_(node_limit), order_(n), load_(d, 0.0),
          count_(d, 0), at_(n, 0), best_at_(n, 0), rest_(n + 1, 0.0) {
        std::iota(order_.begin(), order_.end(), 0);
        std::stable_sort(order_.begin(), order_.end(),
                         [&](int64_t a, int64_t b) { return w_[a] > w_[b]; });
        for (int64_t k = n - 1; k >= 0; --k) rest_[k] = rest_[k + 1] + w_[order_[k]];
        bool integral = true;
        for (int64_t i = 0; i < n; ++i) integral = integral && w_[i] == std::floor(w_[i]);
        // No plan beats the mean or the heaviest item (rounded up for integer weights).
        floor_ = std::max(rest_[0] / static_cast<double>(d), n ? w_[order_[0]] : 0.0);
        if (integral) floor_ = std::ceil(floor_);
        lpt_start();
    }

    // Searches below the LPT plan; true when the plan kept is optimal.
    bool run() {
        if (best_ > floor_) dive(0, 0.0);
        return nodes_ <= node_limit_ || best_ <= floor_;
    }

    std::vector<int64_t> dst() const {
        std::vector<int64_t> out(n_);
        for (int64_t k = 0; k < n_; ++k) out[order_[k]] = best_at_[k];
        return out;
    }

  private:
    // The starting plan: each item, heaviest first, to the least-loaded rank with room (LPT).
    void lpt_start() {
        for (int64_t k = 0; k < n_; ++k) {
            int64_t r = -1;
            for (int64_t q = 0; q < d_; ++q)
                if (count_[q] < cap_ && (r < 0 || load_[q] < load_[r])) r = q;
            best_at_[k] = r;
            load_[r] += w_[order_[k]];
            ++count_[r];
        }
        best_ = *std::max_element(load_.begin(), load_.end());
        std::fill(load_.begin(), load_.end(), 0.0);
        std::fill(count_.begin(), count_.end(), 0);
    }

    void dive(int64_t k, double top) {
        if (++nodes_ > node_limit_ || best_ <= floor_) return;
        if (k == n_) {
            best_ = top;
            best_at_ = at_;
            return;
        }
        // Every rank must end below the best plan's busiest: the ranks with room must hold
        // what is left in the space under it, and have a slot for each item left.
        double space = 0.0;
        int64_t slots = 0;
        for (int64_t r = 0; r < d_; ++r) {
            if (count_[r] >= cap_) continue;
            space += best_ - load_[r];
            slots += cap_ - count_[r];
        }
        if (space <= rest_[k] || slots < n_ - k) return;
        const double x = w_[order_[k]];
        for (int64_t r = 0; r < d_; ++r) {
            if (count_[r] >= cap_ || load_[r] + x >= best_) continue;
            // Ranks in the same state as an earlier one lead to mirror images of its plans.
            bool seen = false;
            for (int64_t q = 0; q < r && !seen; ++q)
                seen = load_[q] == load_[r] && count_[q] == count_[r];
            if (seen) continue;
            load_[r] += x;
            ++count_[r];
            at_[k] = r;
            dive(k + 1, std::max(top, load_[r]));
            load_[r] -= x;
            --count_[r];
            if (nodes_ > node_limit_ || best_ <= floor_) return;
        }
    }

    const double* w_;
    int64_t n_, d_, cap_, node_limit_, nodes_ = 0;
    std::vector<int64_t> order_;
    std::vector<double> load_;
    std::vector<int64_t> count_, at_, best_at_;
    std::vector<double> rest_;  // rest_[k]: weight of items k.. in search order
    double floor_ = 0.0, best_ = 0.0;
};

py::tuple min_makespan(orch::F64 weights, int64_t num_ranks, int64_t max_items,
                       int64_t node_limit) {
    const int64_t n = weights.size();
    if (num_ranks < 1 || max_items < 1 || max_items * num_ranks < n)
        throw std::invalid_argument("min_makespan: max_items * num_ranks must cover the items");
    for (int64_t i = 0; i < n; ++i)
        if (!(weights.data()[i] >= 0) || !std::isfinite(weights.data()[i]))
            throw std::invalid_argument("min_makespan: weights must be finite and >= 0");
    std::vector<int64_t> out;
    bool proven;
    {
        py::gil_scoped_release release;
        Search search(weights.data(), n, num_ranks, max_items, node_limit);
        proven = search.run();
        out = search.dst();
    }
    return py::make_tuple(orch::to_array(out), proven);
}

}  // namespace

void register_exact(py::module_& m) {
    m.def("min_makespan", &min_makespan, py::arg("weights"), py::arg("num_ranks"),
          py::arg("max_items"), py::arg("node_limit"),
          "(rank per item, proven): the lightest busiest rank of non-negative weights on "
          "num_ranks ranks with at most max_items items each; proven: it is the minimum (else "
          "the best within node_limit search nodes).");
}
