// The keep-set search behind greedy_stay's exact candidate (see keep_search.hpp). A plan is
// fixed by what each rank keeps: the rest must fit into the room the kept items leave under
// the limit. Combinations of keep-sets are visited in increasing moved weight (best first,
// over per-rank lists sorted by the weight each sheds), so the first one whose shed items
// pack is optimal.
#include "keep_search.hpp"

#include <algorithm>
#include <cstdint>
#include <queue>
#include <tuple>
#include <utility>
#include <vector>

namespace orch {

namespace {

constexpr int64_t kPackNodes = 4096;  // search nodes per packing attempt, at most

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

}  // namespace orch
