// paramcast._core: the extension module behind the paramcast package.
#include "python/bindings.h"
#include "python/tensors.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "ParamCast's C++ core; use the paramcast package instead.";
  paramcast::python::bind_tensors(m);
  paramcast::python::bind_config(m);
  paramcast::python::bind_publisher(m);
  paramcast::python::bind_subscriber(m);
  paramcast::python::bind_reshard(m);
}
