// ParamCast Statuses as Python exceptions (paramcast.errors).
//
// throw_status raises the paramcast.errors class of the Status's code (one
// family under paramcast.Error; ConfigError for configuration problems) with
// the Status's message and its code name in `.code`.
//
// Thread-safety: call with the GIL held.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/status.h"

namespace paramcast::python {

namespace py = pybind11;

// Raises the Python exception for `s` (which must not be OK); `type` names a
// class of paramcast.errors ("ConfigError"), by default the code's class.
[[noreturn]] void throw_status(const Status& s, const char* type = nullptr);

// "TypeName: message" of the Python exception being handled.
std::string describe(const py::error_already_set& e);

}  // namespace paramcast::python
