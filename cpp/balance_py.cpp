// Python bindings for the balancing algorithms. Arguments are validated in orchmllm/balance.py;
// here arrays are only converted, and every algorithm runs with the GIL released so planning
// can overlap training in a background thread.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <vector>

#include "balance.hpp"

namespace py = pybind11;

namespace {

template <typename T>
using Array = py::array_t<T, py::array::c_style | py::array::forcecast>;
using Ints = Array<int64_t>;
using Floats = Array<double>;

// Runs fn(input_ptr, n, dst_ptr) without the GIL and returns dst (int64, zero-filled).
template <typename T, typename Fn>
Ints run(const Array<T>& input, Fn fn) {
    if (input.ndim() != 1) throw py::value_error("expected a 1-D array");
    const int64_t n = static_cast<int64_t>(input.shape(0));
    Ints dst(n);
    int64_t* out = dst.mutable_data();
    std::fill(out, out + n, 0);
    const T* in = input.data();
    {
        py::gil_scoped_release release;
        fn(in, n, out);
    }
    return dst;
}

}  // namespace

void register_balance(py::module_& m) {
    // The portfolio's size limits, read by the Python reference (orchmllm/balance.py).
    m.attr("PORTFOLIO_KK_WORK") = orch::kPortfolioKkWork;
    m.attr("PORTFOLIO_KK_EQUAL_ITEMS") = orch::kPortfolioKkEqualItems;
    m.attr("PORTFOLIO_MULTIFIT_ITEMS") = orch::kPortfolioMultifitItems;
    m.attr("MULTIFIT_ROUNDS") = orch::kMultifitRounds;
    m.attr("REFINE_WIDE_RANKS") = orch::kWideRanks;
    m.attr("REFINE_WIDE_PARTNERS") = static_cast<int64_t>(orch::kWidePartners);
    m.def(
        "lpt",
        [](const Floats& w, int64_t d, int64_t cap, int64_t max_steps, bool with_proof) {
            bool proven = false;
            Ints dst = run(w, [=, &proven](const double* x, int64_t n, int64_t* o) {
                orch::lpt(x, n, d, cap, o, max_steps, &proven);
            });
            return with_proof ? py::object(py::make_tuple(dst, proven)) : py::object(dst);
        },
        py::arg("weights"), py::arg("num_ranks"), py::arg("cap"), py::arg("max_steps") = 0,
        py::arg("with_proof") = false,
        "Longest-processing-time on additive weights (Alg. 1, greedy_cost); with max_steps > 0 "
        "the refined portfolio of LPT, the exact search, Karmarkar-Karp and MULTIFIT (see "
        "balance.hpp); with_proof: (dst, proven), proven: no plan has a lighter busiest rank.");
    m.def(
        "greedy_lengths",
        [](const Ints& l, int64_t d, int64_t max_steps) -> py::object {
            // balance()'s fast path for the default call: None unless every length is >= 0
            // and one is > 0 (then the validating path raises or deals out by count).
            if (l.ndim() != 1) throw py::value_error("expected a 1-D array");
            const int64_t n = static_cast<int64_t>(l.shape(0));
            const int64_t* x = l.data();
            if (n == 0) return py::none();
            // All alike, lpt's plan is a deal in rounds; each rank's sum is then one product,
            // exact (like the sum item by item) while it stays below 2^53. The scan stops at
            // the first length that differs (the second, mostly).
            const bool alike = std::all_of(x, x + n, [&](int64_t v) { return v == x[0]; });
            if (alike && x[0] <= 0) return py::none();
            const double each = static_cast<double>(x[0]);
            const int64_t most = (n + d - 1) / d;
            Ints dst(n);
            Floats loads(d);
            int64_t* out = dst.mutable_data();
            double* load = loads.mutable_data();
            if (alike && each * static_cast<double>(most) < 0x1p53) {
                {
                    py::gil_scoped_release release;
                    orch::deal_in_rounds(n, d, out);
                    for (int64_t r = 0; r < d; ++r)
                        load[r] = each * static_cast<double>(n / d + (r < n % d));
                }
                return py::make_tuple(dst, loads, max_steps > 0);
            }
            bool proven = false, nonneg = true, any = false;
            {
                py::gil_scoped_release release;
                // Every length's bits or-ed (a vectorized pass): no sign bit, none negative;
                // any bit, one positive; none from 2^53 up, all below.
                uint64_t bits = 0;
                for (int64_t i = 0; i < n; ++i) bits |= static_cast<uint64_t>(x[i]);
                nonneg = (bits >> 63) == 0;
                any = bits != 0;
                bool known = false;
                if (nonneg && any && (bits >> 53) == 0) {
                    known = orch::lpt(x, n, d, n, out, max_steps, &proven, load);
                } else if (nonneg && any) {
                    // Reused across calls on this thread: a fresh 8 MB vector is page-faulted
                    // in on every call (5 ms of a 45 ms plan at 983,040 lengths).
                    thread_local std::vector<double> w;
                    w.assign(x, x + n);
                    known = orch::lpt(w.data(), n, d, n, out, max_steps, &proven, true, load);
                }
                if (nonneg && any && !known) {
                    std::fill(load, load + d, 0.0);
                    for (int64_t i = 0; i < n; ++i)  // bincount's order
                        load[out[i]] += static_cast<double>(x[i]);
                }
            }
            if (!nonneg || !any) return py::none();
            return py::make_tuple(dst, loads, proven);
        },
        py::arg("lengths"), py::arg("num_ranks"), py::arg("max_steps"),
        "The default greedy on lengths in one call: (dst, per-rank token sums, proven optimal), "
        "or None when "
        "a length is negative or all are zero.");
    m.def(
        "greedy_tolerance",
        [](const Ints& l, int64_t d, double tol, int64_t cap) {
            // A negative or NaN window holds no rank at all.
            if (!(tol >= 0)) throw py::value_error("greedy_tolerance: tolerance must be >= 0");
            return run(l, [=](const int64_t* x, int64_t n, int64_t* o) {
                orch::greedy_tolerance(x, n, d, tol, cap, o);
            });
        },
        py::arg("lengths"), py::arg("num_ranks"), py::arg("tolerance"), py::arg("cap"),
        "Alg. 4: greedy on sums, ties within `tolerance` broken by sum of squares.");
    m.def(
        "binary_search",
        [](const Ints& l, int64_t d, int64_t cap) {
            return run(l, [=](const int64_t* x, int64_t n, int64_t* o) {
                orch::binary_search(x, n, d, cap, o);
            });
        },
        py::arg("lengths"), py::arg("num_ranks"), py::arg("cap"),
        "Alg. 2: padded batches, binary search on count*max.");
    m.def(
        "padded_cost",
        [](const Ints& l, int64_t d, double alpha, double beta, double c, double mult, int64_t cap) {
            return run(l, [=](const int64_t* x, int64_t n, int64_t* o) {
                orch::padded_cost(x, n, d, alpha, beta, c, mult, cap, o);
            });
        },
        py::arg("lengths"), py::arg("num_ranks"), py::arg("alpha"), py::arg("beta"),
        py::arg("const"), py::arg("multiplier"), py::arg("cap"),
        "Padded batches under the full padded cost: bisection on the bound.");
    m.def(
        "conv",
        [](const Ints& l, int64_t d, int64_t cap) {
            return run(l, [=](const int64_t* x, int64_t n, int64_t* o) { orch::conv(x, n, d, cap, o); });
        },
        py::arg("lengths"), py::arg("num_ranks"), py::arg("cap"),
        "Alg. 5: padded-attention (ConvTransformer) objective.");
    m.def(
        "karmarkar_karp",
        [](const Floats& w, int64_t d, bool equal) {
            return run(w, [=](const double* x, int64_t n, int64_t* o) {
                orch::karmarkar_karp(x, n, d, equal, o);
            });
        },
        py::arg("weights"), py::arg("num_ranks"), py::arg("equal_counts"),
        "Karmarkar-Karp largest differencing (equal_counts: counts differ by at most one).");
}
