// Greedy and bound-search post-balancing algorithms (see balance.hpp for the contracts).
// Float expressions must round exactly like the Python reference: no fused multiply-add.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "balance.hpp"
#include "exact.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if !defined(__SIZEOF_INT128__)
#error "the balancing core needs unsigned __int128 (GCC or Clang)"
#endif

namespace orch {
namespace {

constexpr uint64_t kSign = uint64_t{1} << 63;

// A rank in the per-item arrays the greedy fills and refines: 32 bits (MAX_RANKS is 2^20) halve
// their traffic against int64 (0.5 to 0.9 ms less in 17 to 19 at 983,040 lengths).
using Rank = int32_t;

// Order-preserving map of a value to uint64 (-0.0 counts as +0.0, like Python's comparison),
// and its inverse.
uint64_t sortable(double x) {
    x += 0.0;
    uint64_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return (bits & kSign) ? ~bits : bits | kSign;
}
uint64_t sortable(int64_t x) { return static_cast<uint64_t>(x) ^ kSign; }
template <typename T>
T unsortable(uint64_t key);
template <>
double unsortable<double>(uint64_t key) {
    const uint64_t bits = (key & kSign) ? key ^ kSign : ~key;
    double x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}
template <>
int64_t unsortable<int64_t>(uint64_t key) {
    return static_cast<int64_t>(key ^ kSign);
}

// Stable LSD radix sort of `from` into `a` (`from` itself, or a vector left as it is) on bits
// [low, low + width) of key(record), in as few passes as cover them with digits of at most
// log2(size) bits (8 to 17): one counting pass over a histogram no longer than the input beats
// two over short ones (983,040 lengths of 17 bits: 5.9 ms against 8.0 ms). `b` is scratch.
template <typename Record, typename Key>
void radix_sort(const std::vector<Record>& from, std::vector<Record>& a, std::vector<Record>& b,
                int low, int width, Key key) {
    if (width <= 0) {
        if (&a != &from) a.assign(from.begin(), from.end());
        return;
    }
    int max_bits = 8;
    while (max_bits < 17 && (size_t{2} << max_bits) <= from.size()) ++max_bits;
    const int passes = (width + max_bits - 1) / max_bits, bits = (width + passes - 1) / passes;
    const uint64_t mask = (uint64_t{1} << bits) - 1;
    thread_local std::vector<size_t> start;  // reused: see SortScratch
    start.resize(mask + 1);
    b.resize(from.size());
    const std::vector<Record>* in = &from;
    for (int shift = low; shift < low + width; shift += bits) {
        std::fill(start.begin(), start.end(), 0);
        for (const auto& t : *in) ++start[(key(t) >> shift) & mask];
        size_t sum = 0;
        for (auto& s : start) sum += std::exchange(s, sum);
        for (const auto& t : *in) b[start[(key(t) >> shift) & mask]++] = t;
        a.swap(b);
        in = &a;
    }
}

// Items sorted by key, descending (or ascending), ties by index ascending: `index` holds item
// indices, `key` the keys in that order (read sequentially by the callers instead of by index).
template <typename T>
struct Sorted {
    std::vector<int64_t> index;
    std::vector<T> key;
};

// Buffers reused by every sort on this thread: fresh multi-megabyte vectors are page-faulted in
// on every call, which costs as much as the sort itself at 10^5 items.
template <typename T>
struct SortScratch {
    Sorted<T> out;
    std::vector<uint64_t> a, b;
    struct Tagged {
        uint64_t key;
        int64_t index;
    };
    std::vector<Tagged> wide_a, wide_b;
};
template <typename Out>
SortScratch<Out>& sort_scratch() {
    thread_local SortScratch<Out> s;
    return s;
}

// An LSD radix sort over only the bits that vary between keys. When they fit beside the item
// index in one uint64, records are 8 bytes (lengths up to 2^15 as doubles: two passes) and the
// key is rebuilt from the record; otherwise records are (key, index) pairs. Keys of type T come
// out as Out (lengths below 2^53 sort on their integer bits, fewer than a double's, and come out
// as the doubles lpt adds up). The result lives in this thread's scratch until the next
// sort_items call with the same Out.
template <typename T, typename Out = T>
const Sorted<Out>& sort_items(const T* key, int64_t n, bool descending) {
    auto& s = sort_scratch<Out>();
    const uint64_t flip = descending ? ~uint64_t{0} : 0;
    uint64_t all_and = ~uint64_t{0}, all_or = 0;
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t k = sortable(key[i]) ^ flip;
        all_and &= k;
        all_or |= k;
    }
    const uint64_t varying = all_and ^ all_or;
    int low = 0, width = 0;
    if (varying != 0) {
        int high = 63;
        while (!((varying >> low) & 1)) ++low;
        while (!((varying >> high) & 1)) --high;
        width = high - low + 1;
    }
    int index_bits = 1;
    while (index_bits < 63 && (int64_t{1} << index_bits) < n) ++index_bits;
    s.out.index.resize(static_cast<size_t>(n));
    s.out.key.resize(static_cast<size_t>(n));
    if (width + index_bits <= 64) {
        const uint64_t field = width == 64 ? ~uint64_t{0} : (uint64_t{1} << width) - 1;
        const uint64_t index_mask = (uint64_t{1} << index_bits) - 1;
        const uint64_t fixed = all_and & ~(field << low);  // the bits every key shares
        auto& a = s.a;
        a.resize(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
            const uint64_t k = sortable(key[i]) ^ flip;
            a[i] = (((k >> low) & field) << index_bits) | static_cast<uint64_t>(i);
        }
        radix_sort(a, a, s.b, index_bits, width, [](uint64_t t) { return t; });
        for (int64_t j = 0; j < n; ++j) {
            s.out.index[j] = static_cast<int64_t>(a[j] & index_mask);
            s.out.key[j] = static_cast<Out>(
                unsortable<T>((((a[j] >> index_bits) << low) | fixed) ^ flip));
        }
    } else {
        auto& a = s.wide_a;
        a.resize(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) a[i] = {sortable(key[i]) ^ flip, i};
        radix_sort(a, a, s.wide_b, low, width, [](const auto& t) { return t.key; });
        for (int64_t j = 0; j < n; ++j) {
            s.out.index[j] = a[j].index;
            s.out.key[j] = static_cast<Out>(unsortable<T>(a[j].key ^ flip));
        }
    }
    return s.out;
}

// The keys of the least-loaded tree: (load, rank) as one unsigned integer ordered by load, then
// rank, with the load field all ones for a full rank (so it never wins while a rank is open).
// WideKeys take any load; PackedKeys take integer loads below 2^(64 - rank bits) - 1 and are half
// the size, which halves the tree walk at 16,384 ranks (about 30 -> 15 ns per item).
struct WideKey {
    using Key = unsigned __int128;
    Key make(double load, bool full, uint64_t rank) const {
        return (Key{full ? ~uint64_t{0} : sortable(load)} << 64) | rank;
    }
    uint64_t rank(Key k) const { return static_cast<uint64_t>(k); }
    uint64_t last_rank() const { return ~uint64_t{0}; }  // the rank field's largest value
};
struct PackedKey {
    using Key = uint64_t;
    int rank_bits;
    Key make(double load, bool full, uint64_t rank) const {
        return ((full ? ~uint64_t{0} : static_cast<uint64_t>(load)) << rank_bits) | rank;
    }
    uint64_t rank(Key k) const { return k & last_rank(); }
    uint64_t last_rank() const { return (uint64_t{1} << rank_bits) - 1; }
};

// The rank bits of PackedKeys over d ranks, and the integer loads they hold: below 2^53 (exact
// in a double) and below the load field's all-ones.
int rank_bits_for(size_t d) {
    int bits = 1;
    while ((size_t{1} << bits) < d) ++bits;
    return bits;
}
double packed_limit(int rank_bits) {
    return std::min(0x1p53, std::ldexp(1.0, 64 - rank_bits) - 1.0);
}

// Least-loaded open rank, ties to the lowest rank: a loser tree over (load, rank) keys, one
// integer compare each. After the winner's load changes, one walk up its leaf's path replays
// its matches; the path's nodes do not depend on the outcomes, so their loads overlap and each
// step is a branch-free compare and select.
template <typename Codec>
class LeastLoaded {
  public:
    using Key = typename Codec::Key;
    LeastLoaded(Codec codec, const std::vector<double>& load, const std::vector<int64_t>& count,
                int64_t cap)
        : codec_(codec), d_(load.size()), loser_(d_) {
        std::vector<Key> win(2 * d_);
        for (size_t r = 0; r < d_; ++r) win[d_ + r] = codec_.make(load[r], count[r] >= cap, r);
        for (size_t node = d_ - 1; node >= 1; --node) {
            const Key x = win[2 * node], y = win[2 * node + 1];
            win[node] = std::min(x, y);
            loser_[node] = std::max(x, y);
        }
        top_ = win[1];
    }
    int64_t top() const { return static_cast<int64_t>(codec_.rank(top_)); }
    // The top rank's load became `load`; `full`: it takes no more items.
    void update_top(double load, bool full) {
        const uint64_t rank = codec_.rank(top_);
        Key k = codec_.make(load, full, rank);
        for (size_t node = (d_ + rank) >> 1; node >= 1; node >>= 1) {
            const Key t = loser_[node];
            loser_[node] = std::max(k, t);
            k = std::min(k, t);
        }
        top_ = k;
    }

  private:
    Codec codec_;
    size_t d_;
    std::vector<Key> loser_;  // loser_[node] for internal nodes 1..d-1; leaf r is node d + r
    Key top_ = 0;
};

// Assigns items k in [from, end) in sorted order, each to the least-loaded rank with room, by
// the loser tree; rank_at[k] records the rank.
template <typename Codec>
void fill_with(Codec codec, const Sorted<double>& items, size_t from, size_t end,
               std::vector<double>& load, std::vector<int64_t>& count, int64_t cap,
               Rank* rank_at) {
    LeastLoaded<Codec> tree(codec, load, count, cap);
    for (size_t k = from; k < end; ++k) {
        const int64_t r = tree.top();
        rank_at[k] = static_cast<Rank>(r);
        load[r] += items.key[k];
        tree.update_top(load[r], ++count[r] >= cap);
    }
}

// Sorts packed (load, rank) keys, given in rank order (`ranked`), ascending into `keys`, given
// the smallest and the largest: stable LSD passes over the bits of the loads' spread alone keep
// equal loads in rank order, so the rank bits take no pass (16,384 ranks: 14 bits; spoken_qa's
// rounds then sort in one pass, not two, video_2fps's in two, not three: 1.8 ms less in 15).
void sort_keys(const std::vector<uint64_t>& ranked, std::vector<uint64_t>& keys,
               std::vector<uint64_t>& scratch, int rank_bits, uint64_t lo, uint64_t hi) {
    const uint64_t base = lo >> rank_bits, spread = (hi >> rank_bits) - base;
    int width = 0;
    while (width < 64 && (spread >> width) != 0) ++width;
    radix_sort(ranked, keys, scratch, 0, width,
               [base, rank_bits](uint64_t t) { return (t >> rank_bits) - base; });
}

// LPT in rounds, the tree's plan without its walk: with the ranks sorted by (load, rank), the
// next items go to the ranks in that order for as long as each is lighter than every rank that
// took an item earlier in the round (at its new load); then the ranks are sorted again. Items
// descending, a round places about one item per rank, so it costs a scan and a short radix
// sort where the tree spends a walk of log2(ranks) steps, each waiting on the last, per item
// (983,040 lengths on 16,384 ranks: about 3 ms against 17 ms). Without a cap only (no rank
// fills up). Places items [from, end); returns the first sorted position not placed: rounds
// stop once one places fewer than a quarter of the ranks, where the tree is cheaper.
size_t fill_in_rounds(PackedKey codec, const Sorted<double>& items, size_t from, size_t end,
                      std::vector<double>& load, std::vector<int64_t>& count, Rank* rank_at) {
    thread_local std::vector<uint64_t> ranked, keys, scratch;  // reused: see SortScratch
    const size_t d = load.size();
    ranked.resize(d);  // each rank's key, in rank order
    for (size_t r = 0; r < d; ++r) ranked[r] = codec.make(load[r], false, r);
    // The smallest and largest key, kept up by the scans (a pass over the ranks less a round).
    uint64_t lo = *std::min_element(ranked.begin(), ranked.end());
    uint64_t hi = *std::max_element(ranked.begin(), ranked.end());
    size_t k = from;
    for (;;) {
        sort_keys(ranked, keys, scratch, codec.rank_bits, lo, hi);
        const size_t start = k;
        uint64_t taken = ~uint64_t{0}, top = 0;  // the smallest, largest new key this round
        size_t i = 0;
        // Raw pointers: the stores below cannot alias a vector's own fields, so no reloads.
        const uint64_t* sorted = keys.data();
        const double* weight = items.key.data();
        uint64_t* key_of = ranked.data();
        int64_t* count_of = count.data();
        for (; i < d && k < end && sorted[i] < taken; ++i, ++k) {
            const uint64_t r = codec.rank(sorted[i]);
            rank_at[k] = static_cast<Rank>(r);
            ++count_of[r];
            // The load field takes the item as an integer add (exact, like the double's; below
            // 2^53, so through int64, one instruction).
            key_of[r] += static_cast<uint64_t>(static_cast<int64_t>(weight[k])) << codec.rank_bits;
            taken = std::min(taken, key_of[r]);
            top = std::max(top, key_of[r]);
        }
        if (k == end || 4 * (k - start) < d) {
            for (size_t r = 0; r < d; ++r)
                load[r] = static_cast<double>(ranked[r] >> codec.rank_bits);
            return k;
        }
        // The ranks from i on took nothing: their keys, sorted, stay.
        lo = i < d ? std::min(taken, keys[i]) : taken;
        hi = i < d ? std::max(top, keys[d - 1]) : top;
    }
}

// Assigns items `index[k]` of weight `key[k]`, k in [from, size), in that order, each to the
// least-loaded rank that still has room; rank_at[k] (when given) records the rank in that order.
// Packed keys when every load stays a non-negative integer that fits beside the rank bits; then,
// without a binding cap, in rounds first (on at least kRoundRanks ranks), and the zero-length
// items (the sorted order's tail) all to the rank the tree would give each of them: the
// least-loaded, whose load they leave as it is. dst is written after the placement, in a
// second pass: the scatter misses the cache on every item. `coming`: whole_total of the items
// placed, when the caller has it (lpt: weight_unit's pass; a pass of its own: 0.5 to 0.8 ms in
// 16 to 24).
constexpr size_t kRoundRanks = 128;  // below, the tree is as fast (measured)
void fill_least_loaded(const Sorted<double>& items, size_t from, std::vector<double>& load,
                       std::vector<int64_t>& count, int64_t cap, int64_t* dst,
                       Rank* rank_at = nullptr, std::optional<double> coming = std::nullopt) {
    thread_local std::vector<Rank> scratch;  // reused: see SortScratch
    const size_t n = items.index.size();
    if (rank_at == nullptr) {
        scratch.resize(n);
        rank_at = scratch.data();
    }
    const int rank_bits = rank_bits_for(load.size());
    const double limit = packed_limit(rank_bits);
    const double held = whole_total(load.data(), static_cast<int64_t>(load.size()));
    if (!coming)
        coming = whole_total(items.key.data() + from, static_cast<int64_t>(n - from));
    if (held >= 0.0 && *coming >= 0.0 && held + *coming < limit) {
        const PackedKey codec{rank_bits};
        const bool uncapped = cap >= static_cast<int64_t>(n);
        size_t live = n;  // without a cap, the items before the zero-length tail
        if (uncapped) {
            const double* key = items.key.data();
            live = static_cast<size_t>(
                std::partition_point(key + from, key + n, [](double x) { return x > 0.0; }) - key);
        }
        size_t k = from;
        if (load.size() >= kRoundRanks && uncapped)
            k = fill_in_rounds(codec, items, from, live, load, count, rank_at);
        if (k < live) fill_with(codec, items, k, live, load, count, cap, rank_at);
        if (live < n) {
            const int64_t r = std::min_element(load.begin(), load.end()) - load.begin();
            std::fill(rank_at + live, rank_at + n, static_cast<Rank>(r));
            count[r] += static_cast<int64_t>(n - live);
        }
    } else {
        fill_with(WideKey{}, items, from, n, load, count, cap, rank_at);
    }
    for (size_t k = from; k < n; ++k) dst[items.index[k]] = rank_at[k];
}

// The heaviest rank (largest load, then lowest rank) and the lightest (smallest load, then
// lowest rank) under point updates: two segment trees over the codec's (load, rank) keys, the
// heaviest's with the rank field reversed. PackedKeys (integer loads) halve the memory each
// step's two walks touch: 0.5 to 1.3 ms less in 17 to 20 at 16,384 ranks (spoken_qa: 9,957
// steps).
template <typename Codec>
class Extremes {
  public:
    Extremes(Codec codec, const std::vector<double>& load)
        : codec_(codec), d_(load.size()), low_(2 * d_), high_(2 * d_) {
        for (size_t r = 0; r < d_; ++r) set_leaf(r, load[r]);
        for (size_t node = d_ - 1; node >= 1; --node) {
            low_[node] = std::min(low_[2 * node], low_[2 * node + 1]);
            high_[node] = std::max(high_[2 * node], high_[2 * node + 1]);
        }
    }
    int64_t lightest() const { return static_cast<int64_t>(codec_.rank(low_[1])); }
    int64_t heaviest() const {
        return static_cast<int64_t>(codec_.last_rank() - codec_.rank(high_[1]));
    }
    // One walk up from the leaf, carrying the new minimum and maximum: each node reads only
    // its sibling, not the node just written below it (a store and a reload per level).
    void update(size_t rank, double load) {
        set_leaf(rank, load);
        Key low = low_[d_ + rank], high = high_[d_ + rank];
        for (size_t node = d_ + rank; node > 1; node >>= 1) {
            low = std::min(low, low_[node ^ 1]);
            high = std::max(high, high_[node ^ 1]);
            low_[node >> 1] = low;
            high_[node >> 1] = high;
        }
    }

  private:
    using Key = typename Codec::Key;
    void set_leaf(size_t r, double load) {
        low_[d_ + r] = codec_.make(load, false, r);
        high_[d_ + r] = codec_.make(load, false, codec_.last_rank() - r);  // larger: lower rank
    }
    Codec codec_;
    size_t d_;
    std::vector<Key> low_, high_;  // node 1 is the root; leaf r is node d + r (d = 1: node 1)
};

// One item on a rank's list; lists are ordered by weight descending, then index ascending.
// WideEntry holds any weight and index; CompactEntry whole weights and indices below 2^32, in
// half the bytes (refine moves them by the million: 1.2 to 1.6 ms less in 20 at 983,040
// lengths).
struct WideEntry {
    double w;
    int64_t index;
};
struct CompactEntry {
    uint32_t w;
    uint32_t index;
};
template <typename E>
bool before(const E& a, const E& b) {
    return a.w > b.w || (a.w == b.w && a.index < b.index);
}

// Every rank's items as a sorted run in one pool (reused across calls on this thread, so no
// page faults and no allocation per rank or step). Runs are laid out in LPT order either all at
// once, by one counting-sort pass, or (`lazy`) each on its first use, by walking the rank's
// chain of sorted positions (each links to the rank's previous one; one sequential pass links
// them). At 983,040 lengths on 16,384 ranks the counting pass cost 3.5 ms of a 21 ms plan
// (16-byte entries);
// the chains win where refine touches a few hundred ranks (video_2fps: 566 steps), and lose
// where it touches most (text: 7,920 steps, 5 ms more). A run that outgrows its room moves to
// the end of the pool with double the room. Runs are addressed by offsets: the pool may
// reallocate, so need() both ranks of a pair before taking pointers.
template <typename E>
class RankLists {
  public:
    RankLists(const Sorted<double>& items, const std::vector<Rank>& rank_at,
              const std::vector<int64_t>& count, bool lazy)
        : items_(items), begin_(count.size(), kUnbuilt), size_(count.begin(), count.end()),
          room_(size_), last_(count.size(), -1) {
        auto& p = pool();
        if (!lazy) {
            p.resize(rank_at.size());
            std::vector<size_t> next(count.size());
            for (size_t r = 0, at = 0; r < count.size(); at += size_[r++]) begin_[r] = next[r] = at;
            for (size_t k = 0; k < rank_at.size(); ++k)
                p[next[rank_at[k]]++] = entry(k);
            return;
        }
        p.clear();
        auto& prev = chain();
        prev.resize(rank_at.size());
        for (size_t k = 0; k < rank_at.size(); ++k) {
            prev[k] = last_[rank_at[k]];
            last_[rank_at[k]] = static_cast<int64_t>(k);
        }
    }
    // Lays out rank r's run (in sorted order: weight descending, index ascending) if not yet.
    void need(int64_t r) {
        if (begin_[r] != kUnbuilt) return;
        auto& p = pool();
        begin_[r] = p.size();
        p.resize(p.size() + room_[r]);
        const auto& prev = chain();
        size_t at = begin_[r] + size_[r];
        for (int64_t k = last_[r]; k >= 0; k = prev[k]) p[--at] = entry(k);
    }
    E* data(int64_t r) { return pool().data() + begin_[r]; }
    size_t size(int64_t r) const { return size_[r]; }
    void erase(int64_t r, size_t at) {
        E* x = data(r);
        std::copy(x + at + 1, x + size_[r], x + at);
        --size_[r];
    }
    void insert(int64_t r, const E& e) {
        if (size_[r] == room_[r]) {
            auto& p = pool();
            const size_t from = begin_[r];
            begin_[r] = p.size();
            room_[r] = 2 * room_[r] + 1;
            p.resize(p.size() + room_[r]);
            std::copy(p.begin() + static_cast<std::ptrdiff_t>(from),
                      p.begin() + static_cast<std::ptrdiff_t>(from + size_[r]),
                      p.begin() + static_cast<std::ptrdiff_t>(begin_[r]));
        }
        E* x = data(r);
        E* at = std::lower_bound(x, x + size_[r], e, before<E>);
        std::copy_backward(at, x + size_[r], x + size_[r] + 1);
        *at = e;
        ++size_[r];
    }

  private:
    static constexpr size_t kUnbuilt = ~size_t{0};
    E entry(size_t k) const {  // sorted position k's item
        return {static_cast<decltype(E::w)>(items_.key[k]),
                static_cast<decltype(E::index)>(items_.index[k])};
    }
    static std::vector<E>& pool() {
        thread_local std::vector<E> p;
        return p;
    }
    static std::vector<int64_t>& chain() {  // chain()[k]: the rank's sorted position before k
        thread_local std::vector<int64_t> c;
        return c;
    }
    const Sorted<double>& items_;
    std::vector<size_t> begin_, size_, room_;
    std::vector<int64_t> last_;  // lazy: each rank's last sorted position, -1 when it has none
};

// A candidate step: move item i from the heaviest rank h to the lightest rank l (j = -1) or swap
// it with item j of l; m = max of the two new loads. The smallest (m, i, j) wins.
struct Step {
    double m;
    int64_t i, j;
    size_t at_h, at_l;
};

// The neighbours of `target` in a run sorted by weight descending: the first entry of the run
// of the smallest weight above target, and the first entry at or below it (the ends when
// missing). Either may be the entry whose weight is nearest to target.
template <typename E>
std::pair<size_t, size_t> around(const E* x, size_t size, double target) {
    const size_t below = static_cast<size_t>(
        std::partition_point(x, x + size, [&](const E& e) { return e.w > target; }) - x);
    if (below == 0) return {size, 0};
    const double w = x[below - 1].w;
    const size_t above = static_cast<size_t>(
        std::partition_point(x, x + below, [&](const E& e) { return e.w > w; }) - x);
    return {above, below};
}

// RankLists are laid out lazily while at most 1/kLazyShare of the ranks are above the floor.
constexpr int64_t kLazyShare = 16;

// Local search after LPT: while the heaviest rank h can shed load, apply the best single move
// or swap of one item between h and a partner rank p that lowers max(load h, load p) below the
// old load of h, until h is at the floor. The partner is the lightest rank; when no step with
// it helps, the next kWidePartners lightest in (load, rank) order, the first that admits a step
// (on at most kWideRanks ranks). The
// pair's maximum is smallest when the weight moving from h to p is nearest to half the gap, so
// a move considers the items of h nearest to half the gap and a swap of item i the items of p
// nearest to w_i - half (one two-pointer walk for all i). At most `max_steps` steps, each
// O(items on the two ranks + log d) (times the partners tried); the Python reference follows
// the same rules (with binary searches) and the same float operations.
template <typename E, typename Codec>
void refine_with(Codec codec, const Sorted<double>& items, const std::vector<Rank>& rank_at,
                 std::vector<double>& load, std::vector<int64_t>& count, int64_t cap,
                 int64_t max_steps, double floor, int64_t* dst, bool wide) {
    Extremes<Codec> extremes(codec, load);
    std::unique_ptr<RankLists<E>> lists;  // built on the first step that needs them
    const int64_t d = static_cast<int64_t>(load.size());
    std::vector<int64_t> partners;
    // The best step between h and p, or one with i < 0.
    const auto pair_step = [&](int64_t h, int64_t p) {
        lists->need(h);
        lists->need(p);
        const E* hs = lists->data(h);
        const E* ls = lists->data(p);
        const size_t kh = lists->size(h), kl = lists->size(p);
        const double lh = load[h], ll = load[p], half = (lh - ll) * 0.5;
        Step best{lh, -1, -1, 0, 0};  // improving steps only: m < load of h
        const auto consider = [&](double m, size_t a, int64_t j, size_t b) {
            const int64_t i = hs[a].index;
            const bool tie = m == best.m && best.i >= 0;
            if (m < best.m || (tie && std::tie(i, j) < std::tie(best.i, best.j)))
                best = {m, i, j, a, b};
        };
        if (count[p] < cap) {
            const auto [above, below] = around(hs, kh, half);
            for (const size_t a : {above, below})
                if (a < kh && hs[a].w > 0) consider(std::max(lh - hs[a].w, ll + hs[a].w), a, -1, 0);
        }
        // around(ls, kl, w_i - half) for every i at once: the target only falls along hs.
        size_t below = 0, above = 0;
        for (size_t a = 0; a < kh; ++a) {
            const double wi = hs[a].w, target = wi - half;
            while (below < kl && ls[below].w > target) ++below;
            if (below > 0)
                while (ls[above].w > ls[below - 1].w) ++above;
            for (const size_t b : {below > 0 ? above : kl, below}) {
                if (b >= kl || !(ls[b].w < wi)) continue;
                const double wj = ls[b].w;
                consider(std::max((lh - wi) + wj, (ll - wj) + wi), a, ls[b].index, b);
            }
        }
        return best;
    };
    for (int64_t step = 0; step < max_steps; ++step) {
        const int64_t h = extremes.heaviest();
        int64_t l = extremes.lightest();
        // A lone item on h cannot leave it without making its partner at least as heavy; no
        // plan goes below the floor.
        if (h == l || count[h] <= 1 || load[h] <= floor) break;
        if (!lists) {
            // Every rank above the floor takes a step or more: when they are few, so are the
            // ranks refine touches.
            const int64_t above =
                std::count_if(load.begin(), load.end(), [&](double x) { return x > floor; });
            lists = std::make_unique<RankLists<E>>(items, rank_at, count, above <= d / kLazyShare);
        }
        Step best = pair_step(h, l);
        if (best.i < 0 && wide && d <= kWideRanks) {
            partners.clear();
            for (int64_t r = 0; r < d; ++r)
                if (r != h && r != l && load[r] < load[h]) partners.push_back(r);
            const auto lighter = [&](int64_t a, int64_t b) {
                return load[a] < load[b] || (load[a] == load[b] && a < b);
            };
            const size_t tried = std::min<size_t>(partners.size(), kWidePartners);
            std::partial_sort(partners.begin(), partners.begin() + tried, partners.end(), lighter);
            partners.resize(tried);
            for (const int64_t p : partners) {
                best = pair_step(h, p);
                if (best.i >= 0) {
                    l = p;
                    break;
                }
            }
        }
        if (best.i < 0) break;
        const E* hs = lists->data(h);
        const E* ls = lists->data(l);
        const double lh = load[h], ll = load[l];
        const E moved = hs[best.at_h];
        lists->erase(h, best.at_h);
        dst[moved.index] = l;
        if (best.j < 0) {
            load[h] = lh - moved.w;
            load[l] = ll + moved.w;
            --count[h];
            ++count[l];
        } else {
            const E back = ls[best.at_l];
            lists->erase(l, best.at_l);
            lists->insert(h, back);
            dst[back.index] = h;
            load[h] = (lh - moved.w) + back.w;
            load[l] = (ll - back.w) + moved.w;
        }
        lists->insert(l, moved);
        extremes.update(static_cast<size_t>(h), load[h]);
        extremes.update(static_cast<size_t>(l), load[l]);
    }
}

// refine on compact lists and packed keys when `compact`: every weight whole below 2^32, every
// index too, and their total below packed_limit (every load fits beside the rank bits).
void refine(const Sorted<double>& items, const std::vector<Rank>& rank_at,
            std::vector<double>& load, std::vector<int64_t>& count, int64_t cap,
            int64_t max_steps, double floor, int64_t* dst, bool compact, bool wide) {
    if (compact)
        refine_with<CompactEntry>(PackedKey{rank_bits_for(load.size())}, items, rank_at, load,
                                  count, cap, max_steps, floor, dst, wide);
    else
        refine_with<WideEntry>(WideKey{}, items, rank_at, load, count, cap, max_steps, floor,
                               dst, wide);
}

// Ranks with room for Alg. 4, ordered by (sum, rank) in a treap whose nodes also hold the
// smallest (sum of squares, sum, rank) of their subtree, so the best rank among those whose sum
// is within `tolerance` of the smallest (a prefix in sum order) is found in one walk down:
// O(log d) per item instead of a scan of the window. Priorities are a fixed hash of the rank,
// so the shape, like the result, is the same on every run.
class OpenRanks {
  public:
    explicit OpenRanks(int64_t d)
        : sum_(d, 0.0), sq_(d, 0.0), left_(d, kNone), right_(d, kNone), best_(d), prio_(d) {
        for (int64_t r = 0; r < d; ++r) {
            uint64_t x = static_cast<uint64_t>(r) + 0x9E3779B97F4A7C15ULL;  // splitmix64
            x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
            x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
            prio_[r] = x ^ (x >> 31);
            root_ = insert(root_, r);
        }
    }
    int64_t best_within(double tolerance) const {
        int64_t x = root_, lowest = root_;
        while (left_[lowest] != kNone) lowest = left_[lowest];
        const double low = sum_[lowest];
        int64_t best = kNone;
        while (x != kNone) {
            if (sum_[x] - low <= tolerance) {  // x and all of its left subtree are inside
                best = better(best, better(x, left_[x] == kNone ? kNone : best_[left_[x]]));
                x = right_[x];
            } else {
                x = left_[x];
            }
        }
        return best;
    }
    // Rank r takes an item: out of the tree, sums updated, back in if it still has room.
    void add(int64_t r, double l, double l2, bool open) {
        root_ = erase(root_, r);
        sum_[r] += l;
        sq_[r] += l2;
        if (open) root_ = insert(root_, r);
    }

  private:
    static constexpr int64_t kNone = -1;
    bool key_less(int64_t a, int64_t b) const {
        return sum_[a] < sum_[b] || (sum_[a] == sum_[b] && a < b);
    }
    int64_t better(int64_t a, int64_t b) const {  // smaller (sq, sum, rank); kNone loses
        if (a == kNone) return b;
        if (b == kNone) return a;
        return std::tie(sq_[a], sum_[a], a) <= std::tie(sq_[b], sum_[b], b) ? a : b;
    }
    void pull(int64_t x) {
        int64_t b = x;
        if (left_[x] != kNone) b = better(b, best_[left_[x]]);
        if (right_[x] != kNone) b = better(b, best_[right_[x]]);
        best_[x] = b;
    }
    // Splits t (not holding r) into the keys before key(r) and those after.
    void split(int64_t t, int64_t r, int64_t& a, int64_t& b) {
        if (t == kNone) {
            a = b = kNone;
            return;
        }
        if (key_less(t, r)) {
            split(right_[t], r, right_[t], b);
            a = t;
        } else {
            split(left_[t], r, a, left_[t]);
            b = t;
        }
        pull(t);
    }
    int64_t insert(int64_t t, int64_t r) {  // r: a node outside the tree
        if (t == kNone || prio_[r] > prio_[t]) {
            split(t, r, left_[r], right_[r]);
            pull(r);
            return r;
        }
        if (key_less(r, t))
            left_[t] = insert(left_[t], r);
        else
            right_[t] = insert(right_[t], r);
        pull(t);
        return t;
    }
    int64_t erase(int64_t t, int64_t r) {  // r: a node in the tree
        if (t == r) return merge(left_[r], right_[r]);
        if (key_less(r, t))
            left_[t] = erase(left_[t], r);
        else
            right_[t] = erase(right_[t], r);
        pull(t);
        return t;
    }
    int64_t merge(int64_t a, int64_t b) {  // every key of a before every key of b
        if (a == kNone) return b;
        if (b == kNone) return a;
        if (prio_[a] > prio_[b]) {
            right_[a] = merge(right_[a], b);
            pull(a);
            return a;
        }
        left_[b] = merge(a, left_[b]);
        pull(b);
        return b;
    }
    std::vector<double> sum_, sq_;
    std::vector<int64_t> left_, right_, best_;
    std::vector<uint64_t> prio_;
    int64_t root_ = kNone;
};

// GetLeastBatches: cut the ascending order into maximal runs whose cost stays within `bound`.
// cost(b, l) is the cost of a batch of b items whose longest is l (monotone in both).
// Writes batch ids into dst when given; returns the number of batches.
template <typename Cost, typename Bound>
int64_t least_batches(const int64_t* len, const std::vector<int64_t>& asc, int64_t cap,
                      Bound bound, Cost cost, int64_t* dst) {
    int64_t batches = 0, count = 0;
    for (const int64_t i : asc) {
        if (batches == 0 || count >= cap || cost(count + 1, len[i]) > bound) {
            ++batches;
            count = 0;
        }
        ++count;
        if (dst != nullptr) dst[i] = batches - 1;
    }
    return batches;
}

}  // namespace

void deal_in_rounds(int64_t n, int64_t num_ranks, int64_t* dst) {
    if (num_ranks < 1) return;  // no rank to deal to: never loop forever
    for (int64_t k = 0; k < n; k += num_ranks)  // no division per item
        for (int64_t r = 0; r < num_ranks && k + r < n; ++r) dst[k + r] = r;
}

void order_desc(const double* w, int64_t n, int64_t* order) {
    const auto& items = sort_items(w, n, true);
    std::copy(items.index.begin(), items.index.end(), order);
}

namespace {

// First-fit decreasing into bins of capacity `bound`: every item, heaviest first, to the
// lowest rank whose load plus the item stays within `bound` and that has room for one more.
// A min-tree over the loads (full ranks hold +inf) finds that rank in one walk down, since
// load + w <= bound is monotone in load. at[k]: the rank of sorted position k (items.index may
// name items far past the positions: the portfolio's live items). Returns false when some item
// fits nowhere.
bool first_fit(const Sorted<double>& items, int64_t d, int64_t cap, double bound,
               std::vector<double>& tree, std::vector<int64_t>& count, int64_t* at) {
    size_t size = 1;
    while (size < static_cast<size_t>(d)) size <<= 1;
    const double inf = std::numeric_limits<double>::infinity();
    tree.assign(2 * size, inf);
    for (int64_t r = 0; r < d; ++r) tree[size + r] = 0.0;
    for (size_t node = size - 1; node >= 1; --node)
        tree[node] = std::min(tree[2 * node], tree[2 * node + 1]);
    count.assign(static_cast<size_t>(d), 0);
    for (size_t k = 0; k < items.index.size(); ++k) {
        const double x = items.key[k];
        if (!(tree[1] + x <= bound)) return false;
        size_t node = 1;
        while (node < size) node = 2 * node + !(tree[2 * node] + x <= bound);
        const size_t r = node - size;
        at[k] = static_cast<int64_t>(r);
        tree[node] = ++count[r] >= cap ? inf : tree[node] + x;
        for (node >>= 1; node >= 1; node >>= 1)
            tree[node] = std::min(tree[2 * node], tree[2 * node + 1]);
    }
    return true;
}

// MULTIFIT where it can still win: bisection on the bin capacity of first_fit from the floor
// (no plan is lighter) up to `top`, the heaviest load that would beat the plan in hand, at most
// kMultifitRounds rounds; with integer weights (`unit` > 0, their divisor) capacities are
// multiples of unit, so the search ends once no multiple lies between the bounds. Writes the
// plan of the smallest capacity that fit (dst[items.index[k]]); false when none did.
bool multifit(const Sorted<double>& items, int64_t d, int64_t cap, double floor, double top,
              double unit, int64_t* dst) {
    thread_local std::vector<double> tree;
    thread_local std::vector<int64_t> count, trial;  // trial: ranks by sorted position
    trial.resize(items.index.size());
    const auto keep = [&]() {
        for (size_t k = 0; k < trial.size(); ++k) dst[items.index[k]] = trial[k];
    };
    double lo = floor, hi = top;
    if (!(lo <= hi)) return false;
    if (first_fit(items, d, cap, lo, tree, count, trial.data())) {
        keep();
        return true;
    }
    bool found = false;
    for (int round = 0; round < kMultifitRounds; ++round) {
        double mid = round == 0 ? hi : lo + (hi - lo) / 2;
        if (unit > 0.0 && round > 0) mid = lo + std::floor((hi - lo) / (2 * unit)) * unit;
        if (round > 0 && !(mid > lo && mid < hi)) break;
        if (first_fit(items, d, cap, mid, tree, count, trial.data())) {
            hi = mid;
            keep();
            found = true;
        } else {
            if (round == 0) return false;
            lo = mid;
        }
    }
    return found;
}

// Loads and counts of `plan` accumulated in the sorted order (the order LPT fills in), and
// each sorted position's rank, as refine() takes them.
void tally(const Sorted<double>& items, const int64_t* plan, std::vector<double>& load,
           std::vector<int64_t>& count, std::vector<Rank>& rank_at) {
    std::fill(load.begin(), load.end(), 0.0);
    std::fill(count.begin(), count.end(), 0);
    for (size_t k = 0; k < items.index.size(); ++k) {
        const int64_t r = plan[items.index[k]];
        rank_at[k] = static_cast<Rank>(r);
        load[r] += items.key[k];
        ++count[r];
    }
}

}  // namespace

namespace {

// lpt on weights of type T (doubles, or lengths below 2^53: see sort_items).
template <typename T>
bool plan_lpt(const T* w, int64_t n, int64_t num_ranks, int64_t cap, int64_t* dst,
              int64_t max_steps, bool* proven, bool exact, double* loads) {
    if (proven != nullptr) *proven = false;
    if (n > 0 && (w[0] > 0.0 || max_steps > 0) &&
        std::all_of(w, w + n, [&](T x) { return x == w[0]; })) {
        // All alike: the sorted order is the input order (ties by index) and LPT deals the
        // items out in rounds of num_ranks, which meets any cap that fits them: the optimum,
        // without a sort. (All zero, plain LPT keeps filling the lowest rank up to the cap.)
        deal_in_rounds(n, num_ranks, dst);
        if (proven != nullptr) *proven = max_steps > 0;
        return false;
    }
    const auto& items = sort_items<T, double>(w, n, true);
    std::vector<double> load(static_cast<size_t>(num_ranks), 0.0);
    std::vector<int64_t> count(static_cast<size_t>(num_ranks), 0);
    if (max_steps <= 0) {
        fill_least_loaded(items, 0, load, count, cap, dst);
        return false;
    }
    // The items that matter: without a binding cap, zero-length items change no load, so every
    // step below plans the others (a prefix of the sorted order) and the zeros stay where LPT
    // put them.
    int64_t live = n;
    if (cap >= n)
        while (live > 0 && items.key[live - 1] == 0.0) --live;
    double total = 0.0, unit = 0.0;
    if constexpr (std::is_integral_v<T>) {
        // Lengths (whole, below 2^53): the divisor from the first runs, and the total in int64,
        // exact while n times the longest stays below 2^53, as is then the double sum in order
        // that weight_unit takes (its pass: 0.4 to 0.6 ms in 17 to 19).
        unit = length_unit(items.key.data(), live);
        if (items.key[0] * static_cast<double>(n) < 0x1p53)
            total = static_cast<double>(std::accumulate(w, w + n, int64_t{0}));
        else
            total = std::accumulate(items.key.data(), items.key.data() + live, 0.0);
    } else {
        unit = weight_unit(items.key.data(), live, &total);
    }
    const double floor = makespan_floor(items.key.data(), live, num_ranks, unit, total);
    thread_local std::vector<Rank> rank_at;  // reused: see SortScratch
    rank_at.resize(static_cast<size_t>(n));
    // With a unit every item is whole (the zero tail too) and `total` is their whole_total;
    // without, fill_least_loaded sees for itself.
    fill_least_loaded(items, 0, load, count, cap, dst, rank_at.data(),
                      unit > 0.0 ? std::optional<double>(total) : std::nullopt);
    // Whole weights below 2^32 (the heaviest first) and item indices too: compact lists.
    const bool compact = unit > 0.0 && items.key[0] < 0x1p32 && n <= (int64_t{1} << 32) &&
                         total < packed_limit(rank_bits_for(static_cast<size_t>(num_ranks)));
    refine(items, rank_at, load, count, cap, max_steps, floor, dst, compact, exact);
    // The refined LPT plan's loads, for the caller (a pass over the plan saved: 0.7 to 1.3 ms
    // in 22).
    const auto report = [&]() {
        const bool known = loads != nullptr && unit > 0.0 && total < 0x1p53;
        if (known) std::copy(load.begin(), load.end(), loads);
        return known;
    };
    double best = *std::max_element(load.begin(), load.end());
    if (!(best > floor) || num_ranks < 2) {
        if (proven != nullptr) *proven = !(best > floor);
        return report();
    }
    // Past every candidate's limit (the exact search's, KK's and MULTIFIT's), the refined LPT
    // plan stands: no copies of a million items for candidates that will not run.
    if (live > kExactItems && live * num_ranks > kPortfolioKkWork &&
        live > kPortfolioKkEqualItems && live > kPortfolioMultifitItems)
        return report();
    Sorted<double> part;  // the live items, in sorted order
    part.index.assign(items.index.begin(), items.index.begin() + live);
    part.key.assign(items.key.begin(), items.key.begin() + live);
    std::vector<Rank> at(static_cast<size_t>(live));
    // Exact where it is cheap: the branch and bound from the plan in hand (exact.hpp).
    if (exact && live <= kExactItems) {
        std::vector<int64_t> plan_at(static_cast<size_t>(live));
        for (int64_t k = 0; k < live; ++k) plan_at[k] = dst[part.index[k]];
        const ExactOutcome outcome = improve_exact(part.key.data(), live, num_ranks, cap, floor,
                                                   kExactNodes, plan_at.data());
        for (int64_t k = 0; k < live; ++k) {
            at[k] = static_cast<Rank>(plan_at[k]);
            dst[part.index[k]] = at[k];
        }
        if (outcome.proven) {
            if (proven != nullptr) *proven = true;
            return false;
        }
        std::fill(load.begin(), load.end(), 0.0);
        for (int64_t k = 0; k < live; ++k) load[at[k]] += part.key[k];
        best = *std::max_element(load.begin(), load.end());
    }
    // The portfolio: KK and MULTIFIT, each refined, replace the plan only when strictly
    // lighter (ties keep the earlier candidate), while it is above the floor and within their
    // work limits, counted in live items.
    std::vector<int64_t> plan(dst, dst + n);
    const auto consider = [&]() {
        tally(part, plan.data(), load, count, at);
        if (*std::max_element(count.begin(), count.end()) > cap) return;
        refine(part, at, load, count, cap, max_steps, floor, plan.data(), compact, exact);
        const double m = *std::max_element(load.begin(), load.end());
        if (m < best) {
            best = m;
            for (const int64_t i : part.index) dst[i] = plan[i];
        }
    };
    // KK on every item where its work allows; past that, its equal-counts variant (rows of
    // num_ranks items differenced: O(items log ranks), about LPT's own cost) up to
    // kPortfolioKkEqualItems.
    const bool full_kk = live * num_ranks <= kPortfolioKkWork;
    if (full_kk || live <= kPortfolioKkEqualItems) {
        std::vector<int64_t> ids(part.index.begin(), part.index.end()), kk(live);
        std::sort(ids.begin(), ids.end());  // KK's ties break by index: keep their order
        std::vector<double> x(static_cast<size_t>(live));
        for (int64_t k = 0; k < live; ++k) x[k] = static_cast<double>(w[ids[k]]);
        karmarkar_karp(x.data(), live, num_ranks, !full_kk, kk.data());
        for (int64_t k = 0; k < live; ++k) plan[ids[k]] = kk[k];
        consider();
    }
    const double top = unit > 0.0 ? best - unit : std::nextafter(best, -HUGE_VAL);
    if (best > floor && live <= kPortfolioMultifitItems &&
        multifit(part, num_ranks, cap, floor, top, unit, plan.data()))
        consider();
    if (proven != nullptr) *proven = !(best > floor);
    return false;
}

}  // namespace

bool lpt(const double* w, int64_t n, int64_t num_ranks, int64_t cap, int64_t* dst,
         int64_t max_steps, bool* proven, bool exact, double* loads) {
    return plan_lpt(w, n, num_ranks, cap, dst, max_steps, proven, exact, loads);
}

bool lpt(const int64_t* lengths, int64_t n, int64_t num_ranks, int64_t cap, int64_t* dst,
         int64_t max_steps, bool* proven, double* loads) {
    return plan_lpt(lengths, n, num_ranks, cap, dst, max_steps, proven, true, loads);
}

void greedy_tolerance(const int64_t* len, int64_t n, int64_t num_ranks, double tolerance,
                      int64_t cap, int64_t* dst) {
    const auto& items = sort_items(len, n, true);
    std::vector<int64_t> count(static_cast<size_t>(num_ranks), 0);
    OpenRanks open(num_ranks);
    for (size_t k = 0; k < items.index.size(); ++k) {
        // The smallest sum sets the window; inside it the smallest sum of squares wins,
        // then the smaller sum, then the lower rank.
        const int64_t best = open.best_within(tolerance);
        const double l = static_cast<double>(items.key[k]);
        dst[items.index[k]] = best;
        open.add(best, l, l * l, ++count[best] < cap);
    }
}

namespace {

// Alg. 2 with batch costs count * length computed in Int, which must hold n * longest.
template <typename Int>
void binary_search_in(const int64_t* len, const std::vector<int64_t>& asc, int64_t n,
                      int64_t num_ranks, int64_t cap, int64_t* dst) {
    const auto cost = [](int64_t b, int64_t l) { return Int{b} * l; };
    const Int longest = len[asc.back()];
    // Bounds: a batch holding the longest item costs at least `longest`; ceil(n/d) items per
    // batch always fit in ceil(n/d)*longest. (The paper's bounds use the shortest length.)
    Int left = longest;
    Int right = longest * ((n + num_ranks - 1) / num_ranks);
    while (left < right) {
        const Int mid = left + (right - left) / 2;
        if (least_batches(len, asc, cap, mid, cost, nullptr) <= num_ranks)
            right = mid;
        else
            left = mid + 1;
    }
    least_batches(len, asc, cap, left, cost, dst);
}

}  // namespace

void binary_search(const int64_t* len, int64_t n, int64_t num_ranks, int64_t cap, int64_t* dst) {
    if (n == 0) return;
    const auto& asc = sort_items(len, n, false).index;
    // Costs reach n * longest, up to 2^126: exact in 128 bits like Python's ints, and in the
    // faster int64 whenever that holds them (every realistic input).
    const unsigned __int128 most = static_cast<unsigned __int128>(n) * len[asc.back()];
    if (most <= static_cast<unsigned __int128>(INT64_MAX))
        binary_search_in<int64_t>(len, asc, n, num_ranks, cap, dst);
    else
        binary_search_in<__int128>(len, asc, n, num_ranks, cap, dst);
}

void padded_cost(const int64_t* len, int64_t n, int64_t num_ranks, double alpha, double beta,
                 double c, double multiplier, int64_t cap, int64_t* dst) {
    if (n == 0) return;
    const auto& asc = sort_items(len, n, false).index;
    const auto cost = [=](int64_t b, int64_t l) {
        const double bd = static_cast<double>(b), ld = static_cast<double>(l);
        return multiplier * (alpha * bd * ld + beta * bd * ld * ld + c);
    };
    const int64_t longest = len[asc.back()];
    double lo = cost(1, longest);
    double hi = cost((n + num_ranks - 1) / num_ranks, longest);
    if (least_batches(len, asc, cap, lo, cost, nullptr) <= num_ranks) {
        hi = lo;
    } else {
        // Invariant: lo infeasible, hi feasible; stop when no double lies strictly between.
        for (;;) {
            const double mid = lo + (hi - lo) / 2;
            if (!(mid > lo && mid < hi)) break;
            if (least_batches(len, asc, cap, mid, cost, nullptr) <= num_ranks)
                hi = mid;
            else
                lo = mid;
        }
    }
    least_batches(len, asc, cap, hi, cost, dst);
}

void conv(const int64_t* len, int64_t n, int64_t num_ranks, int64_t cap, int64_t* dst) {
    if (n == 0) return;
    // b: the objective Alg. 1 reaches on these lengths (its largest batch sum).
    std::vector<double> w(len, len + n);
    std::vector<int64_t> tmp(static_cast<size_t>(n));
    lpt(w.data(), n, num_ranks, cap, tmp.data());
    std::vector<double> load(static_cast<size_t>(num_ranks), 0.0);
    for (int64_t i = 0; i < n; ++i) load[tmp[i]] += w[i];
    const double bound = *std::max_element(load.begin(), load.end());
    std::fill(load.begin(), load.end(), 0.0);

    // Phase 1: longest first, a batch grows while its padded size (count * its first, longest
    // item) stays within the bound; a new batch opens until num_ranks are open.
    const auto& items = sort_items(w.data(), n, true);
    std::vector<int64_t> count(static_cast<size_t>(num_ranks), 0);
    int64_t cur = 0;
    size_t k = 0;
    double first = 0.0;
    for (; k < items.index.size(); ++k) {
        const double x = items.key[k];
        if (count[cur] > 0 && (count[cur] >= cap || (count[cur] + 1) * first > bound)) {
            if (cur + 1 >= num_ranks) break;
            ++cur;
        }
        if (count[cur] == 0) first = x;
        dst[items.index[k]] = cur;
        load[cur] += x;
        ++count[cur];
    }
    // Phase 2: the remaining (shortest) items to the smallest sum of lengths.
    fill_least_loaded(items, k, load, count, cap, dst);
}

}  // namespace orch
