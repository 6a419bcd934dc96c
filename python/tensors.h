// Tensors in and out of Python over DLPack, without copies.
//
// import_tensor borrows the bytes of any object with __dlpack__ (torch,
// numpy, ...) as a TensorView; the returned keepalive owns the DLPack capsule
// and must outlive every use of the view. export_view lends a TensorView to
// Python as an object with __dlpack__/__dlpack_device__, which
// torch.from_dlpack / numpy.from_dlpack turn into a tensor sharing its bytes.
//
// Thread-safety: call with the GIL held.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "common/tensor.h"

namespace paramcast::python {

namespace py = pybind11;

struct BorrowedTensor {
  TensorView view;
  py::object keepalive;  // the capsule that owns the bytes' lifetime
};

// `dtype` overrides the dtype DLPack reports (same element size), for types
// a framework cannot export (torch bool and fp8 go out as uint8 views).
// `stream` is passed to __dlpack__ for CUDA tensors. Raises ValueError naming
// `name`, what was expected and what was got: non-contiguous, unsupported
// dtype, or a device other than `expected`.
BorrowedTensor import_tensor(const std::string& name, py::handle obj, const std::optional<std::string>& dtype,
                             const std::optional<Device>& expected, std::optional<intptr_t> stream);

// Lends `view` to Python; the object must not be used after the view's bytes go away.
py::object export_view(const TensorView& view);

void bind_tensors(py::module_& m);

}  // namespace paramcast::python
