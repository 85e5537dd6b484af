// The two exact searches behind greedy_stay's small-instance candidates (see keep_search.hpp).
// Keep-sets: a plan is fixed by what each rank keeps; the rest must fit into the room the kept
// items leave under the limit. Combinations of keep-sets are visited in increasing moved weight
// (best first, over per-rank lists sorted by the weight each sheds), so the first one whose
// shed items pack is optimal. Items: a depth-first branch and bound, for the instances where
// the cheapest keep-sets do not pack and that order runs out of budget.
#include "keep_search.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <queue>
#include <tuple>
#include <utility>
#include <vector>

#include "balance.hpp"

namespace orch {

namespace {

constexpr int64_t kPackNodes = 4096;  // search nodes per packing attempt, at most
// The item search's waste bound runs while its table, (items + 1) x (limit + 1) entries of 4
// bytes, stays within this many entries (16 MB).
constexpr double kFillMaxEntries = double{1 << 22};

struct KeepSet {
    double shed;    // weight the rank gives up
    double kept;    // weight it keeps
    uint32_t mask;  // bit j: the rank's j-th item (index order) stays
};

// Items (heaviest first) into rooms, each at most its room; depth-first, ranks in index
// order, a rank with the same room as an earlier one tried for the same item skipped.
class Packer {
  public:
    // `budget`: search nodes left for the whole search, shared by every attempt.
    Packer(const double* w, std::vector<double> room, int64_t& budget)
        : w_(w), room_(std::move(room)), budget_(budget) {}

    bool pack(const std::vector<int64_t>& items, std::vector<int64_t>& rank_of) {
        items_ = &items;
        rank_of.assign(items.size(), -1);
        rank_of_ = &rank_of;
        nodes_ = 0;
        return dive(0);
    }

  private:
    bool dive(size_t j) {
        if (j == items_->size()) return true;
        if (++nodes_ > kPackNodes || --budget_ < 0) return false;
        const double x = w_[(*items_)[j]];
        for (size_t r = 0; r < room_.size(); ++r) {
            if (room_[r] < x) continue;
            bool mirror = false;
            for (size_t q = 0; q < r && !mirror; ++q) mirror = room_[q] == room_[r];
            if (mirror) continue;
            room_[r] -= x;
            (*rank_of_)[j] = static_cast<int64_t>(r);
            const bool done = dive(j + 1);
            room_[r] += x;
            if (done) return true;
            if (nodes_ > kPackNodes || budget_ < 0) return false;
        }
        return false;
    }

    const double* w_;
    std::vector<double> room_;
    const std::vector<int64_t>* items_ = nullptr;
    std::vector<int64_t>* rank_of_ = nullptr;
    int64_t nodes_ = 0;
    int64_t& budget_;
};

}  // namespace

std::vector<int64_t> fewest_moved(const double* w, const int64_t* src, int64_t n, int64_t d,
                                  double limit, int64_t max_nodes) {
    if (d > kKeepSearchMaxRanks) return {};
    std::vector<std::vector<int64_t>> on(d);
    for (int64_t i = 0; i < n; ++i) on[src[i]].push_back(i);
    std::vector<std::vector<KeepSet>> sets(d);
    for (int64_t r = 0; r < d; ++r) {
        const int64_t k = static_cast<int64_t>(on[r].size());
        if (k > kKeepSearchMaxItemsPerRank) return {};
        double total = 0.0;
        for (const int64_t i : on[r]) total += w[i];
        for (uint32_t mask = 0; mask < (1u << k); ++mask) {
            double kept = 0.0;
            for (int64_t j = 0; j < k; ++j)
                if (mask >> j & 1u) kept += w[on[r][j]];
            if (kept <= limit) sets[r].push_back({total - kept, kept, mask});
        }
        std::sort(sets[r].begin(), sets[r].end(), [](const KeepSet& a, const KeepSet& b) {
            return std::tie(a.shed, a.mask) < std::tie(b.shed, b.mask);
        });
    }
    // A combination: the position in each rank's list (d entries of `pool` from id * d);
    // successors advance one rank at or after the one its parent advanced, so each
    // combination is reached once.
    std::vector<uint16_t> pool(d, 0);
    using Entry = std::tuple<double, int64_t, int64_t>;  // (moved, pool id, last rank)
    std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap;
    double start = 0.0;
    for (int64_t r = 0; r < d; ++r) start += sets[r][0].shed;
    heap.emplace(start, 0, 0);
    std::vector<int64_t> shed, rank_of;
    int64_t budget = max_nodes;
    while (!heap.empty() && budget > 0) {
        const auto [moved, id, last] = heap.top();
        heap.pop();
        const std::vector<uint16_t> at(pool.begin() + id * d, pool.begin() + (id + 1) * d);
        std::vector<double> room(d);
        shed.clear();
        for (int64_t r = 0; r < d; ++r) {
            const KeepSet& s = sets[r][at[r]];
            room[r] = limit - s.kept;
            for (size_t j = 0; j < on[r].size(); ++j)
                if (!(s.mask >> j & 1u)) shed.push_back(on[r][j]);
        }
        std::sort(shed.begin(), shed.end(),
                  [&](int64_t a, int64_t b) { return w[a] != w[b] ? w[a] > w[b] : a < b; });
        budget -= d;  // the combination's own cost, so that failing packs still count
        Packer packer(w, std::move(room), budget);
        if (packer.pack(shed, rank_of)) {
            std::vector<int64_t> dst(src, src + n);
            for (size_t j = 0; j < shed.size(); ++j) dst[shed[j]] = rank_of[j];
            return dst;
        }
        for (int64_t r = last; r < d; ++r) {
            if (at[r] + 1u >= sets[r].size()) continue;
            const double step = sets[r][at[r] + 1u].shed - sets[r][at[r]].shed;
            const int64_t next = static_cast<int64_t>(pool.size()) / d;
            pool.insert(pool.end(), at.begin(), at.end());
            ++pool[next * d + r];
            heap.emplace(moved + step, next, r);
        }
    }
    return {};
}

namespace {

// Depth-first search over items, heaviest first: each stays or moves to a rank it fits on.
// With nodes, an item moved off its node counts twice, as in greedy_stay (cpp/movement.cpp).
// The bound adds to the weight moved so far, for every rank, the lightest set of its own
// undecided items that it must shed to end under the limit given what it holds now (subset
// sums of each rank's undecided suffix, precomputed). A received item raises the bound at once
// (its rank must now shed more), where the keep-set order learns the room an item needs only
// by failing to pack, combination after combination.
class ItemSearch {
  public:
    ItemSearch(const double* w, const int64_t* src, int64_t n, int64_t d, int64_t c,
               double limit)
        : w_(w), src_(src), n_(n), d_(d), c_(c), limit_(limit), order_(n),
          own_(d), sums_(d), next_(d, 0), rest_(d, 0.0), load_(d, 0.0), need_(d, 0.0),
          dst_(n, -1), ranks_(n * d), key_(d) {
        for (int64_t i = 0; i < n; ++i) order_[i] = i;
        std::sort(order_.begin(), order_.end(),
                  [&](int64_t a, int64_t b) { return w[a] != w[b] ? w[a] > w[b] : a < b; });
        for (const int64_t i : order_) own_[src[i]].push_back(i);
        for (int64_t r = 0; r < d; ++r) {
            const auto& list = own_[r];
            const size_t k = list.size();
            sums_[r].resize(k + 1);
            for (size_t j = 0; j <= k; ++j) {  // subset sums of list[j:]
                const size_t m = k - j;
                std::vector<double>& out = sums_[r][j];
                out.reserve(size_t{1} << m);
                for (uint32_t mask = 0; mask < (1u << m); ++mask) {
                    double s = 0.0;
                    for (size_t b = 0; b < m; ++b)
                        if (mask >> b & 1u) s += w[list[j + b]];
                    out.push_back(s);
                }
                std::sort(out.begin(), out.end());
            }
            for (const int64_t i : list) rest_[r] += w[i];
        }
        build_fill();
    }

    // A plan moving less than `incumbent`, or empty: max_nodes search nodes in the stay-first
    // order, then, unless that search ended within them, as many in the bound-first order
    // from the best plan it found (see Order).
    std::vector<int64_t> run(double incumbent, int64_t max_nodes) {
        best_ = incumbent;
        double bound = 0.0;
        for (int64_t r = 0; r < d_; ++r) bound += (need_[r] = must_shed(r));
        for (const Order order : {Order::kStayFirst, Order::kBoundFirst}) {
            order_kind_ = order;
            budget_ = max_nodes;
            dive(0, 0.0, bound);
            if (budget_ >= 0) break;  // searched to the end: nothing moves less
        }
        return found_;
    }

  private:
    // Lightest weight rank r's undecided own items can shed to bring it under the limit.
    double must_shed(int64_t r) const { return must_shed_at(r, load_[r]); }

    // The same, were rank r to hold `load` instead of what it holds now.
    double must_shed_at(int64_t r, double load) const {
        const double excess = load + rest_[r] - limit_;
        if (excess <= 0.0) return 0.0;
        const std::vector<double>& s = sums_[r][next_[r]];
        const auto it = std::lower_bound(s.begin(), s.end(), excess);
        return it == s.end() ? kInfinity : *it;
    }

    void dive(int64_t t, double moved, double bound) {
        if (moved + bound + off_node_excess() >= best_) return;
        if (t == n_) {
            best_ = moved;
            found_ = dst_;
            return;
        }
        if (--budget_ < 0) return;
        if (wastes_too_much(t)) return;
        const int64_t i = order_[t], s = src_[i];
        const double x = w_[i];
        rest_[s] -= x;
        ++next_[s];
        int64_t* const to = &ranks_[t * d_];
        const int64_t count = order_choices(t, to);
        const double need_s = need_[s];
        for (int64_t k = 0; k < count; ++k) {
            const int64_t q = to[k];
            const double need_q = need_[q];
            load_[q] += x;
            need_[s] = must_shed(s);
            if (q != s) need_[q] = must_shed(q);
            dst_[i] = q;
            const double next_bound = bound - need_s - (q != s ? need_q : 0.0) + need_[s] +
                                      (q != s ? need_[q] : 0.0);
            dive(t + 1, moved + cost(i, q), next_bound);
            load_[q] -= x;
            need_[q] = need_q;
            need_[s] = need_s;
            if (budget_ < 0) break;
        }
        rest_[s] += x;
        --next_[s];
    }

    // The order in which the search tries the ranks for an item. kStayFirst: stay, then the
    // other ranks cheapest first (with nodes: the item's own node). kBoundFirst: the child's
    // bound first, the weight the move costs plus how much more its source and its
    // destination must then shed, so that a received item forcing its rank to shed one of its
    // own comes late, and moving comes first where staying forces the source to shed more than
    // the item weighs. Staying heavy items first, whatever that forces, spends the budget
    // under plans that shed too much where the limit is tight and the ranks many (16 ranks x
    // 4-8 items: uniform, librispeech, spoken_qa lengths); bound first misses what stay first
    // finds on some tight Pareto instances at 8 ranks, so run() tries both.
    enum class Order { kStayFirst, kBoundFirst };

    // The ranks item i = order_[t] (source s, already out of s's undecided items) can go to,
    // into `to`, in order_kind_'s order; returns how many. Ties: stay first, then the fullest
    // rank (best fit), then by rank.
    int64_t order_choices(int64_t t, int64_t* to) {
        const int64_t i = order_[t], s = src_[i];
        const double x = w_[i];
        const double gone = must_shed_at(s, load_[s]);  // what s sheds if i leaves
        int64_t count = 0;
        const int64_t floor = twin_floor(t);
        for (int64_t q = 0; q < d_; ++q) {
            if (load_[q] + x > limit_ || (q == s ? -1 : q) < floor) continue;
            to[count++] = q;
            if (order_kind_ == Order::kStayFirst)
                key_[q] = q == s ? -1.0 : cost(i, q);
            else
                key_[q] = q == s ? must_shed_at(s, load_[s] + x)
                                 : cost(i, q) + gone + must_shed_at(q, load_[q] + x) - need_[q];
        }
        std::sort(to, to + count, [&](int64_t a, int64_t b) {
            if (key_[a] != key_[b]) return key_[a] < key_[b];
            if ((a == s) != (b == s)) return a == s;
            return load_[a] != load_[b] ? load_[a] > load_[b] : a < b;
        });
        return count;
    }

    // Items of equal weight and source are interchangeable: of the plans that only swap
    // their destinations, the search visits the one whose destinations do not decrease along
    // the order (staying counts as -1). Returns the least destination item i may take so:
    // the previous item's in order_ where that is its twin, else -1. Item i = order_[t].
    int64_t twin_floor(int64_t t) const {
        if (t == 0) return -1;
        const int64_t i = order_[t], p = order_[t - 1];
        if (w_[p] != w_[i] || src_[p] != src_[i]) return -1;
        return dst_[p] == src_[p] ? -1 : dst_[p];
    }

    // With nodes: what a node holds and its ranks' undecided own items, beyond what its ranks
    // can hold under the limit, must leave the node, each token once more on top of leaving
    // its rank (which `bound` counts).
    double off_node_excess() const {
        if (c_ <= 0) return 0.0;
        double extra = 0.0;
        for (int64_t first = 0; first < d_; first += c_) {
            const int64_t last = std::min(first + c_, d_);
            double held = 0.0;
            for (int64_t r = first; r < last; ++r) held += load_[r] + rest_[r];
            extra += std::max(0.0, held - static_cast<double>(last - first) * limit_);
        }
        return extra;
    }

    // Integer weights and limit: the room every rank leaves unused in a full plan adds up to
    // slack = d * limit - total, and a rank cannot fill more of its room than the largest
    // subset sum of the undecided items that fits (fill_[t][room]: that sum over items
    // order_[t:]). A partial plan whose ranks must leave more unused than the slack has no
    // completion: on tight instances (few items filling the limit to a few tokens) this cuts
    // what the moved-weight bound cannot (Pareto lengths, 8 ranks x 6 items: the minimum in
    // 2^19 nodes, where 2^25 found nothing better than the heuristics without it).
    void build_fill() {
        const double total = whole_total(w_, n_);
        const bool integral = total >= 0.0 && std::isfinite(limit_) && limit_ >= 0.0;
        if (!integral || (n_ + 1) * (std::floor(limit_) + 1) > kFillMaxEntries) return;
        cap_ = static_cast<int64_t>(limit_);
        slack_ = static_cast<double>(d_) * static_cast<double>(cap_) - total;
        const size_t width = static_cast<size_t>(cap_) + 1;
        fill_.resize((n_ + 1) * width);
        std::vector<char> reach(width, 0), next(width);
        reach[0] = 1;  // the empty set
        for (int64_t t = n_;; --t) {
            int32_t* f = &fill_[t * width];
            for (size_t room = 0; room < width; ++room)
                f[room] = reach[room] ? static_cast<int32_t>(room) : f[room - 1];
            if (t == 0) break;
            const double x = w_[order_[t - 1]];
            next = reach;
            if (x <= static_cast<double>(cap_))
                for (size_t sum = static_cast<size_t>(x); sum < width; ++sum)
                    next[sum] |= reach[sum - static_cast<size_t>(x)];
            reach.swap(next);
        }
    }

    // Whether the ranks must leave more room unused than the slack, items order_[t:] undecided.
    bool wastes_too_much(int64_t t) const {
        if (fill_.empty()) return false;
        const int32_t* f = &fill_[t * (cap_ + 1)];
        double waste = 0.0;
        for (int64_t q = 0; q < d_; ++q) {
            const int64_t room = cap_ - static_cast<int64_t>(load_[q]);
            waste += static_cast<double>(room - f[room]);
        }
        return waste > slack_;
    }

    // What item i on rank q moves: its weight off its rank, twice that off its node (c > 0).
    double cost(int64_t i, int64_t q) const {
        if (q == src_[i]) return 0.0;
        return c_ > 0 && q / c_ != src_[i] / c_ ? 2.0 * w_[i] : w_[i];
    }

    static constexpr double kInfinity = std::numeric_limits<double>::infinity();
    const double* w_;
    const int64_t* src_;
    int64_t n_, d_, c_;
    double limit_;
    int64_t budget_ = 0;
    std::vector<int64_t> order_;
    std::vector<std::vector<int64_t>> own_;                // per rank, heaviest first
    std::vector<std::vector<std::vector<double>>> sums_;  // [rank][first undecided]
    std::vector<int64_t> next_;                           // first undecided own item
    std::vector<double> rest_, load_, need_;              // undecided own, placed, bound
    std::vector<int64_t> dst_, found_;
    std::vector<int64_t> ranks_;  // the ranks tried for the item at each depth
    std::vector<double> key_;     // order_choices' sort keys, by rank
    Order order_kind_ = Order::kStayFirst;
    double best_ = 0.0;
    std::vector<int32_t> fill_;  // [t][room], empty: the waste bound is off (see build_fill)
    int64_t cap_ = 0;
    double slack_ = 0.0;
};

}  // namespace

std::vector<int64_t> fewest_moved_by_items(const double* w, const int64_t* src, int64_t n,
                                           int64_t d, int64_t ranks_per_node, double limit,
                                           double incumbent, int64_t max_nodes) {
    if (d > kKeepSearchMaxRanks) return {};
    std::vector<int64_t> count(d, 0);
    for (int64_t i = 0; i < n; ++i)
        if (++count[src[i]] > kKeepSearchMaxItemsPerRank) return {};
    return ItemSearch(w, src, n, d, ranks_per_node, limit).run(incumbent, max_nodes);
}

}  // namespace orch
