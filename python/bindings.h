// The parts of the paramcast._core extension module, one per file:
// tensors (DLPack import/export), config_binding (dict -> YAML -> the
// loader), publisher_binding (submit, and a wait the caller interrupts),
// subscriber_binding (Python hooks on the data thread), reshard_binding (the
// many-sender plan), errors; module.cc puts them together. The Python
// classes over them are python/paramcast/ (integrations/vllm.py: the vLLM
// weight-transfer backend; reshard.py: what a rank holds, from its DTensors
// or a layout stated as data). `pip install .` builds it with the same CMake
// (scikit-build-core); docs/python.md.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/config.h"

namespace paramcast::python {

namespace py = pybind11;

Config config_from_dict(const py::dict& d);

void bind_config(py::module_& m);
void bind_publisher(py::module_& m);
void bind_subscriber(py::module_& m);
void bind_reshard(py::module_& m);

}  // namespace paramcast::python
