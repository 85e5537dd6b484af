// The exact smallest makespan (exact.hpp): the branch and bound the default `greedy` runs on
// small instances (balance.cpp) and orchmllm/exact.py exposes for the cap search of balance().
#include "exact.hpp"
#include "balance.hpp"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <unordered_set>
#include <vector>

#include "balance.hpp"
#include "numpy_arrays.hpp"

namespace py = pybind11;

namespace orch {

double weight_unit(const double* x, int64_t m, double* total) {
    uint64_t g = 0;
    bool whole = true;
    double sum = 0.0;
    for (int64_t i = 0; i < m; ++i) {
        sum += x[i];
        whole &= x[i] < 0x1p53 && is_whole(x[i]);
        // Once the divisor is 1 only integrality is left to check, and a repeat of the last
        // weight (runs of them when sorted) leaves it as it is: a division per item costs a
        // third of greedy's time at a million lengths (video_2fps's, all multiples of 576,
        // never reach 1).
        if (whole && g != 1 && (i == 0 || x[i] != x[i - 1]))
            g = std::gcd(g, static_cast<uint64_t>(x[i]));
    }
    if (total != nullptr) *total = sum;
    return whole ? static_cast<double>(g) : 0.0;
}

double length_unit(const double* x, int64_t m) {
    uint64_t g = 0;
    for (int64_t i = 0; i < m && g != 1; ++i)
        if (i == 0 || x[i] != x[i - 1]) g = std::gcd(g, static_cast<uint64_t>(x[i]));
    return static_cast<double>(g);
}

double makespan_floor(const double* x, int64_t m, int64_t d, double unit, double total) {
    if (m == 0) return 0.0;
    double floor = std::max(total / static_cast<double>(d), x[0]);
    // Among the k*d + 1 heaviest items some rank holds k + 1, at least the k + 1 lightest of
    // them. Only a few k matter: the bound falls towards the mean as k grows.
    constexpr int64_t kWindows = 8;
    for (int64_t k = 1; k <= kWindows && k * d + 1 <= m; ++k) {
        double sum = 0.0;
        for (int64_t j = k * d - k; j <= k * d; ++j) sum += x[j];
        floor = std::max(floor, sum);
    }
    if (unit > 0.0) floor = std::ceil(floor / unit) * unit;
    return floor;
}

namespace {

// Depth-first over the items, heaviest first: item k goes to each rank it fits on below the
// best plan's busiest rank, least loaded first. A branch ends when the room left under that
// limit on ranks that can still take the lightest item is less than the weight left, or the
// ranks have fewer free slots than items left; when the least-loaded rank with room for every
// item left takes them all within the limit (a plan at once); and, without a binding cap, an
// item that fills a rank exactly to the limit goes only there (any plan under the limit can
// swap that rank's later items with it).
class Search {
  public:
    Search(const double* x, int64_t m, int64_t d, int64_t cap, double floor, int64_t node_limit,
           int64_t* plan)
        : x_(x), m_(m), d_(d), cap_(cap), floor_(floor), node_limit_(node_limit), plan_(plan),
          unit_(weight_unit(x, m)), load_(d, 0.0), count_(d, 0), at_(m, 0), rest_(m + 1, 0.0),
          cand_(static_cast<size_t>(m * d)) {
        for (int64_t k = m - 1; k >= 0; --k) rest_[k] = rest_[k + 1] + x[k];
        std::vector<double> load(d, 0.0);
        for (int64_t k = 0; k < m; ++k) load[plan[k]] += x[k];
        best_ = m ? *std::max_element(load.begin(), load.end()) : 0.0;
        limit_ = below(best_);
    }

    ExactOutcome run() {
        if (m_ > 0 && best_ > floor_) dive(0, 0.0);
        return {nodes_ <= node_limit_ || best_ <= floor_, nodes_};
    }

  private:
    // The heaviest load a strictly lighter plan may have.
    double below(double best) const {
        return unit_ > 0.0 ? best - unit_ : std::nextafter(best, -HUGE_VAL);
    }
    bool done() const { return nodes_ > node_limit_ || best_ <= floor_; }

    void keep(double top) {
        best_ = top;
        limit_ = below(top);
        std::copy(at_.begin(), at_.end(), plan_);
    }

    void dive(int64_t k, double top) {
        if (++nodes_ > node_limit_) return;
        if (k == m_) {
            keep(top);
            return;
        }
        const double lightest = x_[m_ - 1], rest = rest_[k];
        double room = 0.0;
        int64_t slots = 0, sink = -1;
        for (int64_t r = 0; r < d_; ++r) {
            if (count_[r] >= cap_) continue;
            const double free = limit_ - load_[r];
            if (free >= lightest) room += free;
            slots += cap_ - count_[r];
            if (count_[r] + (m_ - k) <= cap_ && (sink < 0 || load_[r] < load_[sink])) sink = r;
        }
        if (room < rest || slots < m_ - k) return;
        if (sink >= 0 && load_[sink] + rest <= limit_) {
            for (int64_t j = k; j < m_; ++j) at_[j] = sink;
            keep(std::max(top, load_[sink] + rest));
            return;
        }
        const double w = x_[k];
        int64_t* cand = cand_.data() + k * d_;
        int64_t size = 0;
        for (int64_t r = 0; r < d_; ++r) {
            if (count_[r] >= cap_ || load_[r] + w > limit_) continue;
            bool seen = false;  // a rank in the same state leads to mirror images of its plans
            for (int64_t t = 0; t < size && !seen; ++t)
                seen = load_[cand[t]] == load_[r] && count_[cand[t]] == count_[r];
            if (seen) continue;
            int64_t t = size++;  // insertion by (load, rank)
            while (t > 0 && load_[cand[t - 1]] > load_[r]) {
                cand[t] = cand[t - 1];
                --t;
            }
            cand[t] = r;
        }
        int64_t first = -1;  // a perfect fit, tried alone while the limit stays
        if (cap_ >= m_)
            for (int64_t t = 0; t < size && first < 0; ++t)
                if (load_[cand[t]] + w == limit_) first = t;
        if (first >= 0) {
            const double limit = limit_;
            place(k, cand[first], top);
            if (done() || limit_ == limit) return;
        }
        for (int64_t t = 0; t < size; ++t) {
            if (t == first || load_[cand[t]] + w > limit_) continue;
            place(k, cand[t], top);
            if (done()) return;
        }
    }

    void place(int64_t k, int64_t r, double top) {
        const double w = x_[k];
        load_[r] += w;
        ++count_[r];
        at_[k] = r;
        dive(k + 1, std::max(top, load_[r]));
        load_[r] -= w;
        --count_[r];
    }

    const double* x_;
    int64_t m_, d_, cap_;
    double floor_;
    int64_t node_limit_;
    int64_t* plan_;
    double unit_;
    std::vector<double> load_;
    std::vector<int64_t> count_, at_;
    std::vector<double> rest_;  // rest_[k]: weight of items k.. (sorted order)
    std::vector<int64_t> cand_;  // candidate ranks, d per depth
    double best_ = 0.0, limit_ = 0.0;
    int64_t nodes_ = 0;
};


// Bitset row `to` = `from` | `from` shifted by v: the sums reached with one more item of v
// units, kept to `limit` (words: limit / 64 + 1).
void add_item(const uint64_t* from, uint64_t* to, int64_t words, uint64_t v, uint64_t limit) {
    const int64_t skip = std::min(static_cast<int64_t>(v / 64), words);
    const int bits = static_cast<int>(v % 64);
    std::copy(from, from + skip, to);
    if (bits == 0) {
        for (int64_t w = skip; w < words; ++w) to[w] = from[w] | from[w - skip];
    } else if (skip < words) {
        to[skip] = from[skip] | (from[0] << bits);
        for (int64_t w = skip + 1; w < words; ++w)
            to[w] = from[w] | (from[w - skip] << bits) | (from[w - skip - 1] >> (64 - bits));
    }
    if (limit % 64 != 63) to[words - 1] &= (uint64_t{1} << (limit % 64 + 1)) - 1;
}

// Bin completion (Korf 2002) for up to 64 integer weights, on the decision "do the items fit d ranks of
// capacity C": ranks are filled one at a time, each taking the heaviest item left and then a
// maximal set of the others (no item left fits in what stays free), sets of least waste first.
// The waste a plan may leave, d*C minus the total, is tiny near the mean, so few sets qualify.
// The smallest C is found from the floor up: C = floor, then bisection below the best plan.
class Completion {
  public:
    Completion(const double* x, int64_t m, int64_t d, int64_t cap, double unit,
               int64_t node_limit)
        : x_(x), m_(m), d_(d), cap_(cap), node_limit_(node_limit), unit_(unit), trial_(m, 0) {
        total_ = 0.0;
        for (int64_t k = 0; k < m; ++k) total_ += x[k];
    }
    int64_t nodes() const { return nodes_; }
    bool out_of_nodes() const { return nodes_ > node_limit_; }
    void set_node_limit(int64_t limit) { node_limit_ = limit; }

    // 1: a plan within capacity c (in plan), 0: none exists, -1: out of nodes.
    int decide(double c, int64_t* plan) {
        capacity_ = c;
        failed_.clear();
        const uint64_t all = m_ == 64 ? ~uint64_t{0} : (uint64_t{1} << m_) - 1;
        const int found = fill(0, all, d_ * c - total_);
        if (found == 1) std::copy(trial_.begin(), trial_.end(), plan);
        return found;
    }

  private:
    struct Set {
        double sum;
        uint64_t mask;
    };

    int fill(int64_t b, uint64_t left, double waste) {
        if (left == 0) return 1;
        if (b == d_ || waste < 0.0) return 0;
        if (++nodes_ > node_limit_) return -1;
        // The ranks are alike, so what is left decides alone; equal weights are taken lowest
        // position first, so equal sets of weights left are equal masks.
        if (failed_.count(left) || !could_fit(left, d_ - b)) return 0;
        const int64_t first = __builtin_ctzll(left);  // the heaviest item left
        const uint64_t rest = left & (left - 1);
        sets_.clear();
        room_ = capacity_ - x_[first];
        waste_ = waste;
        count_room_ = cap_ - 1;
        sums_reached(rest);
        collect(rest, 0, 0.0, 0, 0);
        if (out_of_nodes()) return -1;
        // Least waste first, ties by the set of lower positions (the heavier items).
        std::vector<Set> sets(sets_.begin(), sets_.end());
        std::sort(sets.begin(), sets.end(), [](const Set& a, const Set& b) {
            return a.sum > b.sum || (a.sum == b.sum && a.mask < b.mask);
        });
        for (const Set& s : sets) {
            const uint64_t taken = s.mask | (uint64_t{1} << first);
            for (uint64_t t = taken; t; t &= t - 1) trial_[__builtin_ctzll(t)] = b;
            const int found = fill(b + 1, left & ~taken, waste - (room_of(first) - s.sum));
            if (found != 0) return found;
        }
        failed_.insert(left);
        return 0;
    }
    // The floor's argument on what is left: among the k*bins + 1 heaviest items left, k + 1
    // share a rank, so the k + 1 lightest of them must fit together.
    bool could_fit(uint64_t left, int64_t bins) const {
        int64_t seen = 0;
        double window[4] = {0.0, 0.0, 0.0, 0.0};  // the last 4 heaviest seen
        for (uint64_t t = left; t; t &= t - 1) {
            const double w = x_[__builtin_ctzll(t)];
            window[seen & 3] = w;
            ++seen;
            for (int64_t k = 1; k <= 3; ++k) {
                if (seen != k * bins + 1) continue;
                double sum = 0.0;
                for (int64_t j = 0; j <= k; ++j) sum += window[(seen - 1 - j) & 3];
                if (sum > capacity_) return false;
            }
            if (seen > 3 * bins) break;
        }
        return true;
    }
    double room_of(int64_t first) const { return capacity_ - x_[first]; }

    // Sets of the items in `pool` from position `from` on, added to `mask` (sum, count):
    // the maximal ones whose waste fits, each once even when weights repeat.
    void collect(uint64_t pool, int64_t from, double sum, int64_t count, uint64_t mask) {
        if (++nodes_ > node_limit_) return;
        const double free = room_ - sum;
        // Maximal: no item of the pool outside the set fits in what stays free.
        const uint64_t outside = pool & ~mask;
        const int64_t lightest = outside ? 63 - __builtin_clzll(outside) : -1;
        const bool full = count >= count_room_ || lightest < 0 || x_[lightest] > free;
        if (full) {
            if (free <= waste_ && !dominated(outside, mask, free)) sets_.push_back({sum, mask});
            return;
        }
        double prev = -1.0;
        // The pool's positions from `from` on: none past 63 (a shift by 64 is undefined, and on
        // x86 shifts by 0: it read past x_ and revisited the set's own items).
        const uint64_t later = from < 64 ? pool & (~uint64_t{0} << from) : 0;
        double reach = 0.0;  // weight of the pool's items from position p on
        for (uint64_t t = later; t; t &= t - 1) reach += x_[__builtin_ctzll(t)];
        for (uint64_t t = later; t; t &= t - 1) {
            const int64_t p = __builtin_ctzll(t);
            if (sum + reach < room_ - waste_) return;  // even every item left leaves too much
            reach -= x_[p];
            if (x_[p] == prev || x_[p] > free) continue;
            prev = x_[p];
            if (words_ > 0) {  // the set with p must end within the waste: can its rest?
                const int64_t top = units(free - x_[p]);
                if (!any_in(reach_.data() + (index_[p] + 1) * words_,
                            std::max<int64_t>(top - units(waste_), 0), top))
                    continue;
            }
            collect(pool, p + 1, sum + x_[p], count + 1, mask | (uint64_t{1} << p));
            if (out_of_nodes()) return;
        }
    }

    // Exact: w is a multiple of the unit below 2^53.
    int64_t units(double w) const { return static_cast<int64_t>(w / unit_); }

    // The sums (in units, up to the room) that the pool's items from each on reach, a bitset
    // per pool item in position order (reach_, words_ words each, index_ by position), so
    // collect() follows only the items after which a set can still end within the waste: of
    // the partial sets it would walk, most can never fill a rank that closely. Past
    // kMaxCells, words_ = 0 and collect() walks without it. Counts items * words / 64 nodes.
    void sums_reached(uint64_t pool) {
        constexpr int64_t kMaxCells = int64_t{1} << 16;
        const int64_t n = __builtin_popcountll(pool), top = units(room_);
        words_ = top / 64 + 1;
        if ((n + 1) * words_ > kMaxCells) {
            words_ = 0;
            return;
        }
        nodes_ += n * words_ / 64 + 1;
        reach_.resize(static_cast<size_t>((n + 1) * words_));  // rows 0..n-1: add_item's
        std::fill(reach_.begin() + n * words_, reach_.end(), 0);
        reach_[n * words_] = 1;  // after the last item: the empty set
        int64_t at[64], i = 0;
        for (uint64_t t = pool; t; t &= t - 1) {
            at[i] = __builtin_ctzll(t);
            index_[at[i]] = i;
            ++i;
        }
        for (i = n - 1; i >= 0; --i)  // the sums of items i.. : those of i + 1.. and with i
            add_item(reach_.data() + (i + 1) * words_, reach_.data() + i * words_, words_,
                     static_cast<uint64_t>(units(x_[at[i]])), static_cast<uint64_t>(top));
    }
    // Whether `bits` holds a sum in [lo, hi].
    static bool any_in(const uint64_t* bits, int64_t lo, int64_t hi) {
        if (lo > hi) return false;
        const int64_t a = lo / 64, b = hi / 64;
        const uint64_t first = ~uint64_t{0} << (lo % 64);
        const uint64_t last = hi % 64 == 63 ? ~uint64_t{0} : (uint64_t{1} << (hi % 64 + 1)) - 1;
        if (a == b) return bits[a] & first & last;
        if (bits[a] & first) return true;
        for (int64_t w = a + 1; w < b; ++w)
            if (bits[w]) return true;
        return bits[b] & last;
    }

    // Dominance (Martello and Toth): when an item left out is heavier than one item of the set
    // (or, without a binding cap, exactly as heavy as two or three of them together) and fits
    // in their place, any plan through this set maps to one through the swapped set, which is
    // fuller, so this set need not be searched. Swaps only ever make a set fuller (or, at equal
    // weight, hold fewer items), so an undominated set always remains.
    bool dominated(uint64_t outside, uint64_t mask, double free) {
        if (outside == 0) return false;
        int64_t in[64], k = 0, n = 0;
        for (uint64_t t = mask; t; t &= t - 1) in[k++] = __builtin_ctzll(t);
        double out[64];  // the weights left out, heaviest first
        for (uint64_t t = outside; t; t &= t - 1) out[n++] = x_[__builtin_ctzll(t)];
        // Every swap gives up at least the set's lightest item.
        if (k == 0 || out[0] < x_[in[k - 1]]) return false;
        // Some item left out weighs in [sum, sum + free], more than sum unless `several`: the
        // heaviest one within sum + free decides.
        const auto swap_in = [&](double sum, bool several) {
            const double* w = std::partition_point(out, out + n, [&](double v) {
                return v > sum + free;
            });
            return w != out + n && (*w > sum || (several && *w == sum));
        };
        const bool multi = cap_ >= m_;
        // Sums of one, two or three of the set's items, heaviest first: in each loop the sum
        // only falls, so the ones above every item left out plus the free room are skipped.
        const double top = out[0] + free;
        int64_t queries = 0;
        bool found = false;
        const auto query = [&](double sum, bool several) {
            if (sum > top) return;
            ++queries;
            found = swap_in(sum, several);
        };
        for (int64_t a = 0; a < k && !found; ++a) {
            const double wa = x_[in[a]];
            query(wa, false);
            for (int64_t b = a + 1; multi && b < k && !found; ++b) {
                const double wab = wa + x_[in[b]];
                query(wab, true);
                for (int64_t c = b + 1; c < k && !found; ++c) query(wab + x_[in[c]], true);
            }
        }
        nodes_ += queries / 8;  // a binary search each: the work a node stands for
        return found;
    }

    const double* x_;
    int64_t m_, d_, cap_, node_limit_, nodes_ = 0;
    double unit_;
    std::vector<int64_t> trial_;
    std::vector<uint64_t> reach_;  // sums_reached()
    int64_t words_ = 0, index_[64] = {};
    std::vector<Set> sets_;
    std::unordered_set<uint64_t> failed_;  // sets of items left that fit no plan
    double total_ = 0.0, capacity_ = 0.0, room_ = 0.0, waste_ = 0.0;
    int64_t count_room_ = 0;
};

// Ranks rebalanced exactly, for integer weights, before bin completion: with many items per
// rank the sums a few ranks reach are dense, and plans that no pair of ranks can improve meet
// the floor where bin completion would search long for them. A pair's items are split by a
// subset-sum bitset (bits: sums in units) so that its heavier side is lightest; the split
// replaces the pair's when that side is lighter than the pair's heavier rank. Where no pair
// improves, a chain of three: the heaviest rank h keeps the heaviest subset of h and p below
// its load, and p's remainder is split with a third rank q, when all three end below h's old
// load. Heaviest ranks first, partners lightest first; every change lowers the loads sorted
// heaviest first (lexicographically), so it ends at a plan neither step improves, at the
// floor, or out of nodes (a bitset counts items * words / 64 + 1). Deterministic.
class PairBalance {
  public:
    PairBalance(const double* x, int64_t m, int64_t d, int64_t cap, double unit, double floor,
                int64_t node_limit, int64_t* plan)
        : x_(x), m_(m), d_(d), cap_(cap), unit_(unit), floor_(floor), node_limit_(node_limit),
          plan_(plan), load_(d, 0.0), count_(d, 0), order_(d) {
        for (int64_t k = 0; k < m; ++k) {
            load_[plan[k]] += x[k];
            ++count_[plan[k]];
        }
    }

    // Returns the nodes used.
    int64_t run() {
        while (nodes_ <= node_limit_) {
            std::iota(order_.begin(), order_.end(), 0);
            std::sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) {
                return load_[a] > load_[b] || (load_[a] == load_[b] && a < b);
            });
            if (load_[order_[0]] <= floor_ || !(pairs() || chain())) break;
        }
        return nodes_;
    }

  private:
    bool out_of_nodes() const { return nodes_ > node_limit_; }

    bool pairs() {
        for (int64_t a = 0; a < d_ && !out_of_nodes(); ++a)
            for (int64_t b = d_ - 1; b > a && !out_of_nodes(); --b) {
                const int64_t h = order_[a], p = order_[b];
                if (load_[h] - load_[p] <= unit_) break;  // balanced to the unit
                gather({h, p});
                const uint64_t total = sum_of(value_);
                const int64_t light = best_subset(total / 2);
                if (light < 0) continue;
                const double heavier = static_cast<double>(total - light) * unit_;
                if (heavier < load_[h] && fits(in_, members_.size())) {
                    assign(members_, in_, p, h);
                    return true;
                }
            }
        return false;
    }

    bool chain() {
        const int64_t h = order_[0];
        const uint64_t below = static_cast<uint64_t>(load_[h] / unit_) - 1;  // in units
        for (int64_t a = 1; a < d_ && !out_of_nodes(); ++a) {
            const int64_t p = order_[a];
            gather({h, p});
            const uint64_t total = sum_of(value_);
            const int64_t kept = best_subset(below);
            if (kept < 0 || total - kept <= below) continue;  // (a pair's step would do)
            const std::vector<int64_t> first = members_;
            const std::vector<char> keep = in_;
            std::vector<int64_t> moved;  // what p holds after h keeps its subset
            for (size_t j = 0; j < first.size(); ++j)
                if (!keep[j]) moved.push_back(first[j]);
            if (std::count(keep.begin(), keep.end(), 1) > cap_) continue;
            for (int64_t c = d_ - 1; c >= 1 && !out_of_nodes(); --c) {
                const int64_t q = order_[c];
                if (q == p) continue;
                const uint64_t rest = total - kept + static_cast<uint64_t>(load_[q] / unit_);
                if (rest > 2 * below) continue;
                gather({q}, moved);
                const int64_t light = best_subset(rest / 2);
                if (light < 0 || rest - light > below || !fits(in_, members_.size())) continue;
                assign(first, keep, h, p);
                assign(members_, in_, q, p);
                return true;
            }
        }
        return false;
    }

    // members_ and value_ (units): the items of `ranks`, after `extra`.
    void gather(std::initializer_list<int64_t> ranks, const std::vector<int64_t>& extra = {}) {
        members_ = extra;
        for (int64_t k = 0; k < m_; ++k)
            for (const int64_t r : ranks)
                if (plan_[k] == r) members_.push_back(k);
        value_.clear();
        for (const int64_t k : members_) value_.push_back(static_cast<uint64_t>(x_[k] / unit_));
    }
    static uint64_t sum_of(const std::vector<uint64_t>& v) {
        return std::accumulate(v.begin(), v.end(), uint64_t{0});
    }
    // Both sides within the cap: in_ marks one side of `n` members.
    bool fits(const std::vector<char>& in, size_t n) const {
        const int64_t k = std::count(in.begin(), in.begin() + n, 1);
        return k <= cap_ && static_cast<int64_t>(n) - k <= cap_;
    }
    // The members marked go to rank `yes`, the others to `no`.
    void assign(const std::vector<int64_t>& members, const std::vector<char>& in, int64_t yes,
                int64_t no) {
        for (size_t j = 0; j < members.size(); ++j) {
            const int64_t k = members[j], r = in[j] ? yes : no;
            load_[plan_[k]] -= x_[k];
            --count_[plan_[k]];
            plan_[k] = r;
            load_[r] += x_[k];
            ++count_[r];
        }
    }

    // The heaviest subset of value_ within `limit` units: its sum, and in_ marks it; -1 past
    // kMaxCells or the node budget.
    int64_t best_subset(uint64_t limit) {
        constexpr int64_t kMaxCells = int64_t{1} << 18;  // items x words of the bitsets
        const int64_t n = static_cast<int64_t>(value_.size());
        const int64_t words = static_cast<int64_t>(limit / 64) + 1;
        if ((n + 1) * words > kMaxCells) return -1;
        nodes_ += n * words / 64 + 1;
        if (out_of_nodes()) return -1;
        rows_.resize(static_cast<size_t>((n + 1) * words));  // rows 1..n: add_item's
        std::fill(rows_.begin(), rows_.begin() + words, 0);
        rows_[0] = 1;  // row j: the sums of items before j; the empty set's
        for (int64_t j = 0; j < n; ++j)
            add_item(rows_.data() + j * words, rows_.data() + (j + 1) * words, words, value_[j],
                     limit);
        const uint64_t* last = rows_.data() + n * words;
        int64_t w = words - 1;
        while (last[w] == 0) --w;
        uint64_t sum = static_cast<uint64_t>(w) * 64 + (63 - __builtin_clzll(last[w]));
        const int64_t best = static_cast<int64_t>(sum);
        // Walking back, an item is in when its sum was not reachable without it.
        in_.assign(static_cast<size_t>(n), 0);
        for (int64_t j = n - 1; j >= 0; --j) {
            const uint64_t* before = rows_.data() + j * words;
            if ((before[sum / 64] >> (sum % 64)) & 1) continue;
            in_[j] = 1;
            sum -= value_[j];
        }
        return best;
    }

    const double* x_;
    int64_t m_, d_, cap_;
    double unit_, floor_;
    int64_t node_limit_;
    int64_t* plan_;
    std::vector<double> load_;
    std::vector<int64_t> count_, order_, members_;
    std::vector<uint64_t> value_, rows_;
    std::vector<char> in_;
    int64_t nodes_ = 0;
};
}  // namespace

constexpr int64_t kProbeNodes = int64_t{1} << 10;

ExactOutcome improve_exact(const double* x, int64_t m, int64_t d, int64_t cap, double floor,
                           int64_t node_limit, int64_t* plan) {
    // Bin completion counts waste as d*C minus the total, exact only for integer weights; on
    // fractional ones (cost models) a rounding could refute the capacity a plan fills exactly.
    const double unit = weight_unit(x, m);
    if (m > 64 || unit == 0.0) return Search(x, m, d, cap, floor, node_limit, plan).run();
    std::vector<double> load(d, 0.0);
    const auto heaviest = [&](const int64_t* at) {
        std::fill(load.begin(), load.end(), 0.0);
        for (int64_t k = 0; k < m; ++k) load[at[k]] += x[k];
        return m ? *std::max_element(load.begin(), load.end()) : 0.0;
    };
    double best = heaviest(plan);
    // Capacities below lo hold no plan (loads are multiples of the unit); one at best does.
    double lo = std::ceil(floor / unit) * unit;
    // Bin completion first within kProbeNodes (small instances end here, at a few nodes);
    // then pairs and chains rebalance the best plan, and bin completion goes on with the rest.
    Completion search(x, m, d, cap, unit, std::min(node_limit, kProbeNodes));
    std::vector<int64_t> trial(m);
    int64_t paired = 0;
    // Pairs and chains from the plan in hand, within what bin completion left; they stop at
    // lo, the bound proven so far.
    const auto rebalance = [&]() {
        if (!(lo < best) || node_limit <= search.nodes() + paired) return;
        paired += PairBalance(x, m, d, cap, unit, lo, node_limit - search.nodes() - paired,
                              plan)
                      .run();
        best = heaviest(plan);
        search.set_node_limit(node_limit - paired);
    };
    const auto bisect = [&](bool polish) {  // the floor first, then halves; until out of nodes
        for (int round = 0; lo < best && round < 128; ++round) {
            const double c =
                round == 0 ? lo : lo + std::floor((best - unit - lo) / (2 * unit)) * unit;
            const int found = search.decide(c, trial.data());
            if (found < 0) return;
            if (found == 1) {
                best = heaviest(trial.data());
                std::copy(trial.begin(), trial.end(), plan);
                if (polish) rebalance();  // a new start for them
            } else {
                lo = c + unit;
            }
        }
    };
    bisect(false);
    if (lo < best) {
        rebalance();
        bisect(true);
    }
    const int64_t used = paired + search.nodes();
    if (!(lo < best)) return {true, used};
    // Out of nodes: the budget's rest goes to the item-by-item search from the best plan (the
    // order of a complete greedy search), above the floor the bisection has proven.
    const int64_t left = std::max<int64_t>(node_limit - used, 0);
    const ExactOutcome items = Search(x, m, d, cap, lo, left, plan).run();
    return {items.proven, used + items.nodes};
}

}  // namespace orch

namespace {

// The floor of sorted weights with their own unit and total (one pass for both).
double floor_of(const double* x, int64_t m, int64_t d) {
    double total = 0.0;
    const double unit = orch::weight_unit(x, m, &total);
    return orch::makespan_floor(x, m, d, unit, total);
}

py::tuple min_makespan(orch::F64 weights, int64_t num_ranks, int64_t max_items,
                       int64_t node_limit) {
    const int64_t n = weights.size();
    if (num_ranks < 1 || max_items < 1 || max_items * num_ranks < n)
        throw std::invalid_argument("min_makespan: max_items * num_ranks must cover the items");
    for (int64_t i = 0; i < n; ++i)
        if (!(weights.data()[i] >= 0) || !std::isfinite(weights.data()[i]))
            throw std::invalid_argument("min_makespan: weights must be finite and >= 0");
    std::vector<int64_t> out(n);
    orch::ExactOutcome outcome;
    {
        py::gil_scoped_release release;
        // Heaviest first, ties by index; the start is longest-processing-time under the cap.
        std::vector<int64_t> order(n);
        orch::order_desc(weights.data(), n, order.data());
        std::vector<double> x(n), load(num_ranks, 0.0);
        std::vector<int64_t> count(num_ranks, 0), plan(n);
        for (int64_t k = 0; k < n; ++k) {
            x[k] = weights.data()[order[k]];
            int64_t r = -1;
            for (int64_t q = 0; q < num_ranks; ++q)
                if (count[q] < max_items && (r < 0 || load[q] < load[r])) r = q;
            plan[k] = r;
            load[r] += x[k];
            ++count[r];
        }
        const double floor = floor_of(x.data(), n, num_ranks);
        outcome = orch::improve_exact(x.data(), n, num_ranks, max_items, floor, node_limit,
                                      plan.data());
        for (int64_t k = 0; k < n; ++k) out[order[k]] = plan[k];
    }
    return py::make_tuple(orch::to_array(out), outcome.proven, outcome.nodes);
}

py::tuple improve_exact_py(orch::F64 x, int64_t num_ranks, int64_t max_items, double floor,
                           int64_t node_limit, orch::I64 plan) {
    const int64_t n = x.size();
    if (num_ranks < 1 || max_items < 1 || max_items * num_ranks < n)
        throw std::invalid_argument("improve_exact: max_items * num_ranks must cover the items");
    orch::check_range(plan, n, num_ranks, "improve_exact: plan");
    for (int64_t k = 0; k + 1 < n; ++k)
        if (!(x.data()[k] >= x.data()[k + 1]))
            throw std::invalid_argument("improve_exact: weights must be sorted descending");
    std::vector<int64_t> out(plan.data(), plan.data() + n);
    orch::ExactOutcome outcome;
    {
        py::gil_scoped_release release;
        outcome = orch::improve_exact(x.data(), n, num_ranks, max_items, floor, node_limit,
                                      out.data());
    }
    return py::make_tuple(orch::to_array(out), outcome.proven, outcome.nodes);
}

}  // namespace

void register_exact(py::module_& m) {
    m.attr("EXACT_ITEMS") = orch::kExactItems;
    m.attr("EXACT_NODES") = orch::kExactNodes;
    m.def("makespan_floor", [](orch::F64 x, int64_t d) {
        return floor_of(x.data(), x.size(), d);
    }, py::arg("sorted_weights"), py::arg("num_ranks"),
          "The floor no plan goes below (exact.hpp), on weights sorted descending.");
    m.def("improve_exact", &improve_exact_py, py::arg("sorted_weights"), py::arg("num_ranks"),
          py::arg("max_items"), py::arg("floor"), py::arg("node_limit"), py::arg("plan"),
          "(plan, proven, nodes): `plan` (rank per sorted position) improved by the exact "
          "search within node_limit nodes; proven: no lighter plan exists.");
    m.def("min_makespan", &min_makespan, py::arg("weights"), py::arg("num_ranks"),
          py::arg("max_items"), py::arg("node_limit"),
          "(rank per item, proven, nodes): the lightest busiest rank of non-negative weights on "
          "num_ranks ranks with at most max_items items each; proven: it is the minimum (else "
          "the best within node_limit search nodes); nodes: search nodes visited.");
}
