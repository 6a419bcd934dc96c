// The parts of the paramcast._core extension module, one per file.
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
