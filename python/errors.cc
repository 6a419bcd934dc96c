#include "python/errors.h"

namespace paramcast::python {

void throw_status(const Status& s, const char* type) {
  py::module_ errors = py::module_::import("paramcast.errors");
  py::object cls = type ? errors.attr(type) : errors.attr("for_code")(code_name(s.code()));
  py::object e = cls(s.message());
  e.attr("code") = std::string(code_name(s.code()));
  PyErr_SetObject(cls.ptr(), e.ptr());
  throw py::error_already_set();
}

std::string describe(const py::error_already_set& e) {
  std::string type = py::str(e.type().attr("__name__"));
  std::string message = py::str(e.value());
  return message.empty() ? type : type + ": " + message;
}

}  // namespace paramcast::python
