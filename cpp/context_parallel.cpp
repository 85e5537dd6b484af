// Context-parallel balancing (see context_parallel.hpp for the contract).
// Float expressions must round like the Python side's cost model: no fused multiply-add.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "context_parallel.hpp"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "balance.hpp"
#include "numpy_arrays.hpp"

namespace py = pybind11;

namespace orch {
namespace {

// Each rank's load (const included once it holds work) and the least-loaded rank, ties to the
// lower rank: a segment tree of rank indices over the loads.
class Ranks {
  public:
    Ranks(int64_t d, double fixed) : fixed_(fixed), load_(d, 0.0), busy_(d, false) {
        size_ = 1;
        while (size_ < static_cast<size_t>(d)) size_ <<= 1;
        tree_.assign(2 * size_, -1);
        for (int64_t r = 0; r < d; ++r) tree_[size_ + r] = r;
        for (size_t node = size_ - 1; node >= 1; --node) pull(node);
    }
    double load(int64_t r) const { return load_[r]; }
    // The load r would have after taking `cost` more.
    double after(int64_t r, double cost) const {
        return busy_[r] ? load_[r] + cost : (load_[r] + cost) + fixed_;
    }
    void add(int64_t r, double cost) {
        load_[r] = after(r, cost);
        busy_[r] = true;
        for (size_t node = (size_ + r) >> 1; node >= 1; node >>= 1) pull(node);
    }
    int64_t least() const { return tree_[1]; }
    const std::vector<double>& loads() const { return load_; }

  private:
    bool lighter(int64_t a, int64_t b) const {
        if (a < 0) return false;
        if (b < 0) return true;
        return load_[a] < load_[b] || (load_[a] == load_[b] && a < b);
    }
    void pull(size_t node) {
        const int64_t a = tree_[2 * node], b = tree_[2 * node + 1];
        tree_[node] = lighter(b, a) ? b : a;
    }
    double fixed_;
    std::vector<double> load_;
    std::vector<bool> busy_;
    size_t size_ = 1;
    std::vector<int64_t> tree_;
};

struct Row {
    int64_t item, rank, start, end;
};

// One candidate plan and its busiest rank's load.
struct Candidate {
    std::vector<int64_t> dst;
    std::vector<double> loads;
    std::vector<Row> rows;
    double top = 0.0;
};

// Tokens of the heaviest of k pieces of an item of l tokens.
double largest_piece(const PackedCost& cost, int64_t l, int64_t k) {
    return cost.piece(static_cast<double>(l), static_cast<double>((l + k - 1) / k),
                      static_cast<double>(k));
}

// The rows of an item of l tokens cut in k pieces on `ranks` (ascending) holding `tokens`
// each: rank j holds front chunk j and back chunk 2k-1-j (floor and ceil of half its tokens),
// the two merged when adjacent (the middle rank), empty ranges left out; ordered by start.
void layout(int64_t item, int64_t l, const std::vector<int64_t>& ranks,
            const std::vector<int64_t>& tokens, std::vector<Row>& rows) {
    const size_t k = ranks.size();
    std::vector<int64_t> front_end(k), back_start(k);
    int64_t at = 0, back = l;
    for (size_t j = 0; j < k; ++j) {
        at += tokens[j] / 2;
        front_end[j] = at;
        back -= tokens[j] - tokens[j] / 2;
        back_start[j] = back;
    }
    int64_t start = 0;
    for (size_t j = 0; j < k; ++j) {
        const int64_t fe = front_end[j];
        const bool merged = j + 1 == k;  // its back chunk starts where its front chunk ends
        const int64_t end = merged ? (j == 0 ? l : back_start[j - 1]) : fe;
        if (end > start) rows.push_back({item, ranks[j], start, end});
        start = fe;
    }
    for (size_t j = k - 1; j-- > 0;) {
        const int64_t end = j == 0 ? l : back_start[j - 1];
        if (end > back_start[j]) rows.push_back({item, ranks[j], back_start[j], end});
    }
}

// A split plan: items with pieces[i] > 1 first (heaviest piece first), each on the k lightest
// ranks of its best group (of its best node, when k <= node < group); then the whole items by
// LPT.
Candidate split_plan(const int64_t* len, const std::vector<double>& w,
                     const std::vector<int64_t>& pieces, int64_t d, int64_t group, int64_t node,
                     const PackedCost& cost) {
    const int64_t n = static_cast<int64_t>(w.size());
    Candidate c;
    c.dst.assign(n, -1);
    Ranks ranks(d, cost.fixed());
    std::vector<int64_t> gangs, whole;
    std::vector<double> key(n);
    for (int64_t i = 0; i < n; ++i) {
        if (pieces[i] > 1) {
            gangs.push_back(i);
            key[i] = largest_piece(cost, len[i], pieces[i]);
        } else {
            whole.push_back(i);
            key[i] = w[i];
        }
    }
    // Ties to the longer item (equal heaviest pieces of unequal items lay out differently),
    // then by index: a shuffled input gets the same loads.
    const auto heaviest = [&](int64_t a, int64_t b) {
        if (key[a] != key[b]) return key[a] > key[b];
        return len[a] > len[b] || (len[a] == len[b] && a < b);
    };
    std::sort(gangs.begin(), gangs.end(), heaviest);
    std::sort(whole.begin(), whole.end(), heaviest);
    std::vector<std::vector<Row>> item_rows(static_cast<size_t>(n));
    std::vector<std::pair<double, int64_t>> members(static_cast<size_t>(group));
    std::vector<int64_t> best_ranks, chosen, tokens;
    std::vector<double> cost_of;
    for (const int64_t i : gangs) {
        const int64_t l = len[i], k = pieces[i], q = l / k, extra = l % k;
        const double dl = static_cast<double>(l), dk = static_cast<double>(k);
        const double heavy = cost.piece(dl, static_cast<double>(q + 1), dk);
        const double light = cost.piece(dl, static_cast<double>(q), dk);
        double best = std::numeric_limits<double>::infinity();
        best_ranks.clear();
        // The blocks the pieces may go to: a node's ranks when they can hold them (the gather
        // stays inside the node), else a group's.
        const int64_t span = node > 0 && node < group && k <= node ? node : group;
        for (int64_t g = 0; g < d / span; ++g) {
            double least = std::numeric_limits<double>::infinity();
            for (int64_t j = 0; j < span; ++j) {
                const int64_t r = g * span + j;
                members[j] = {ranks.load(r), r};
                least = std::min(least, members[j].first);
            }
            // No rank of this group can do better than its lightest plus the lighter piece.
            if (!best_ranks.empty() && !(least + light < best)) continue;
            // The k lightest, lightest first (ties to the lower rank): the heavier pieces
            // (one more token) to the lighter ranks.
            std::partial_sort(members.begin(), members.begin() + k, members.begin() + span);
            double score = -std::numeric_limits<double>::infinity();
            for (int64_t j = 0; j < k; ++j)
                score = std::max(score, ranks.after(members[j].second, j < extra ? heavy : light));
            if (score < best || best_ranks.empty()) {
                best = score;
                best_ranks.clear();
                for (int64_t j = 0; j < k; ++j) best_ranks.push_back(members[j].second);
            }
        }
        chosen.assign(best_ranks.begin(), best_ranks.end());
        std::sort(chosen.begin(), chosen.end());
        tokens.assign(static_cast<size_t>(k), q);
        for (int64_t j = 0; j < k; ++j) {
            const int64_t r = best_ranks[j];
            const bool big = j < extra;
            ranks.add(r, big ? heavy : light);
            tokens[std::lower_bound(chosen.begin(), chosen.end(), r) - chosen.begin()] += big;
        }
        layout(i, l, chosen, tokens, item_rows[i]);
    }
    for (const int64_t i : whole) {
        const int64_t r = ranks.least();
        c.dst[i] = r;
        ranks.add(r, w[i]);
    }
    for (const auto& rows : item_rows) c.rows.insert(c.rows.end(), rows.begin(), rows.end());
    c.loads = ranks.loads();
    c.top = *std::max_element(c.loads.begin(), c.loads.end());
    return c;
}

// The whole-item portfolio (balance.hpp's lpt on the item costs), its loads summed heaviest
// item first (ties by index: the same sums for a shuffled input), const once per rank
// holding an item.
Candidate whole_plan(const std::vector<double>& w, int64_t d, const PackedCost& cost,
                     int64_t max_steps) {
    const int64_t n = static_cast<int64_t>(w.size());
    Candidate c;
    c.dst.assign(n, 0);
    lpt(w.data(), n, d, n, c.dst.data(), max_steps);
    c.loads.assign(d, 0.0);
    std::vector<bool> busy(d, false);
    std::vector<int64_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return w[a] > w[b]; });
    for (const int64_t i : order) {
        c.loads[c.dst[i]] += w[i];
        busy[c.dst[i]] = true;
    }
    for (int64_t r = 0; r < d; ++r)
        if (busy[r]) c.loads[r] += cost.fixed();
    c.top = *std::max_element(c.loads.begin(), c.loads.end());
    return c;
}

}  // namespace

CpPlan context_parallel(const int64_t* len, int64_t n, int64_t d, int64_t group, int64_t node,
                        const PackedCost& cost, double budget, int64_t max_steps) {
    std::vector<double> w(static_cast<size_t>(n));
    double total = 0.0, heaviest = 0.0, floor_piece = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        w[i] = cost.item(static_cast<double>(len[i]));
        total += w[i];
        heaviest = std::max(heaviest, w[i]);
        const int64_t most = std::max<int64_t>(1, std::min(group, len[i]));
        floor_piece = std::max(floor_piece, w[i] / static_cast<double>(most));
    }
    const double fixed = n > 0 ? cost.fixed() : 0.0;
    const double mean = total / static_cast<double>(d);
    CpPlan out;
    out.lower_bound = std::max(mean, floor_piece) + fixed;

    Candidate best;
    bool found = false, any = false;
    // Ties keep the earlier candidate; an infeasible one counts only while none fits.
    const auto consider = [&](Candidate&& c, bool split) {
        const bool fits = c.top <= budget;
        if (!any || (fits && !found) || (fits == found && c.top < best.top)) {
            best = std::move(c);
            out.split = split;
            found = fits;
        }
        any = true;
        return found && best.top <= out.lower_bound;
    };
    bool done = heaviest + fixed <= budget && consider(whole_plan(w, d, cost, max_steps), false);
    if (!done) {
        // The pieces of each item: from the threshold, then raised until the largest fits.
        const auto cut = [&](auto first) {
            std::vector<int64_t> pieces(static_cast<size_t>(n));
            for (int64_t i = 0; i < n; ++i) {
                const int64_t most = std::max<int64_t>(1, std::min(group, len[i]));
                int64_t k = std::min(most, first(i));
                while (k < most && largest_piece(cost, len[i], k) + fixed > budget) ++k;
                pieces[i] = k;
            }
            return pieces;
        };
        // Finer thresholds tighten LPT's bound (mean + the heaviest piece or whole item);
        // each is kept only where it lowers the busiest rank (ties keep the coarser).
        const double t0 = std::max(mean, floor_piece);
        for (const double t : {t0, t0 / 2, t0 / 4, t0 / 8}) {
            const auto pieces = cut([&](int64_t i) -> int64_t {
                if (!(w[i] > t) || !(t > 0)) return 1;
                const double k = std::ceil(w[i] / t);
                return k >= static_cast<double>(group) ? group : static_cast<int64_t>(k);
            });
            if (consider(split_plan(len, w, pieces, d, group, node, cost), true)) break;
        }
        if (!found) {
            const auto pieces = cut([&](int64_t i) { return len[i] >= group ? group : 1; });
            consider(split_plan(len, w, pieces, d, group, node, cost), true);
        }
    }
    out.feasible = found;
    out.dst = std::move(best.dst);
    out.loads = std::move(best.loads);
    for (const Row& r : best.rows) {
        out.item.push_back(r.item);
        out.rank.push_back(r.rank);
        out.start.push_back(r.start);
        out.end.push_back(r.end);
    }
    return out;
}

}  // namespace orch

void register_context_parallel(py::module_& m) {
    m.def(
        "context_parallel",
        [](const orch::I64& lengths, int64_t d, int64_t group, int64_t node, double alpha,
           double beta, double constant, double multiplier, double budget, int64_t max_steps) {
            if (lengths.ndim() != 1) throw py::value_error("expected a 1-D array");
            if (d < 1 || group < 1 || d % group != 0)
                throw py::value_error("context_parallel: group size must divide num_ranks");
            if (node < 0 || (node > 0 && node < group && group % node != 0))
                throw py::value_error("context_parallel: a node must hold whole groups or tile one");
            const int64_t n = static_cast<int64_t>(lengths.shape(0));
            const orch::PackedCost cost{alpha, beta, constant, multiplier};
            orch::CpPlan plan;
            {
                py::gil_scoped_release release;
                plan = orch::context_parallel(lengths.data(), n, d, group, node, cost, budget,
                                              max_steps);
            }
            py::array_t<double> loads(static_cast<py::ssize_t>(plan.loads.size()));
            std::copy(plan.loads.begin(), plan.loads.end(), loads.mutable_data());
            return py::make_tuple(orch::to_array(plan.dst), loads, orch::to_array(plan.item),
                                  orch::to_array(plan.rank), orch::to_array(plan.start),
                                  orch::to_array(plan.end), plan.feasible, plan.split,
                                  plan.lower_bound);
        },
        py::arg("lengths"), py::arg("num_ranks"), py::arg("group_size"),
        py::arg("ranks_per_node"), py::arg("alpha"),
        py::arg("beta"), py::arg("const"), py::arg("multiplier"), py::arg("budget"),
        py::arg("max_steps"),
        "Context-parallel balance (context_parallel.hpp): (dst with -1 for split items, "
        "loads, piece rows item, rank, start, end, feasible, split, lower_bound).");
}
