// The numpy array types the pybind11 entry points take and return, and their range check:
// one definition for every file of the core.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace orch {

// Input arrays: C-contiguous, converted from any numeric dtype by pybind11.
using I64 = pybind11::array_t<int64_t, pybind11::array::c_style | pybind11::array::forcecast>;
using F64 = pybind11::array_t<double, pybind11::array::c_style | pybind11::array::forcecast>;

inline pybind11::array_t<int64_t> to_array(const std::vector<int64_t>& v) {
    pybind11::array_t<int64_t> out(static_cast<pybind11::ssize_t>(v.size()));
    std::copy(v.begin(), v.end(), out.mutable_data());
    return out;
}

// `a` has `n` entries, each in [0, limit); else invalid_argument naming `name`.
inline void check_range(const I64& a, int64_t n, int64_t limit, const char* name) {
    if (a.size() != n) throw std::invalid_argument(std::string(name) + ": size mismatch");
    const int64_t* p = a.data();
    bool ok = true;
    for (int64_t i = 0; i < n; ++i) ok &= p[i] >= 0 && p[i] < limit;  // no branch: vectorises
    if (!ok) throw std::invalid_argument(std::string(name) + ": index out of range");
}

}  // namespace orch
