// The one pybind11 module of the C++ core. Each concern lives in its own file
// and exposes a register_* function; this file only wires them together.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void register_assignment(py::module_& m);
void register_balance(py::module_& m);
void register_context_parallel(py::module_& m);
void register_exact(py::module_& m);
void register_movement(py::module_& m);
void register_slots(py::module_& m);
void register_traffic(py::module_& m);

PYBIND11_MODULE(_core, m) {
    m.doc() = "OrchMLLM C++ core: balancing algorithms over int64/float64 arrays (no torch).";
    register_assignment(m);
    register_balance(m);
    register_context_parallel(m);
    register_exact(m);
    register_movement(m);
    register_slots(m);
    register_traffic(m);
}
