#include "python/tensors.h"

#include <sstream>

#include "python/dlpack.h"

namespace paramcast::python {
namespace {

constexpr const char* kCapsuleName = "dltensor";

std::string dl_dtype_string(const DLDataType& t) {
  static const char* const kCodes[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
  std::string code = t.code < 7 ? kCodes[t.code] : "code " + std::to_string(t.code);
  std::string s = code + std::to_string(t.bits);
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

std::optional<DType> from_dl(const DLDataType& t) {
  if (t.lanes != 1) return std::nullopt;
  switch (t.code) {
    case kDLFloat:
      if (t.bits == 16) return DType::kF16;
      if (t.bits == 32) return DType::kF32;
      if (t.bits == 64) return DType::kF64;
      return std::nullopt;
    case kDLBfloat: return t.bits == 16 ? std::optional(DType::kBF16) : std::nullopt;
    case kDLInt:
      if (t.bits == 8) return DType::kI8;
      if (t.bits == 16) return DType::kI16;
      if (t.bits == 32) return DType::kI32;
      if (t.bits == 64) return DType::kI64;
      return std::nullopt;
    case kDLUInt: return t.bits == 8 ? std::optional(DType::kU8) : std::nullopt;
    case kDLBool: return t.bits == 8 ? std::optional(DType::kBool) : std::nullopt;
    case kDLFloat8_e4m3fn: return t.bits == 8 ? std::optional(DType::kF8E4M3) : std::nullopt;
    case kDLFloat8_e5m2: return t.bits == 8 ? std::optional(DType::kF8E5M2) : std::nullopt;
    default: return std::nullopt;
  }
}

// bool and fp8 leave as uint8: frameworks that have them view the bytes back
// (the exported object says the ParamCast dtype).
DLDataType to_dl(DType d) {
  switch (d) {
    case DType::kF32: return {kDLFloat, 32, 1};
    case DType::kF16: return {kDLFloat, 16, 1};
    case DType::kF64: return {kDLFloat, 64, 1};
    case DType::kBF16: return {kDLBfloat, 16, 1};
    case DType::kI8: return {kDLInt, 8, 1};
    case DType::kI16: return {kDLInt, 16, 1};
    case DType::kI32: return {kDLInt, 32, 1};
    case DType::kI64: return {kDLInt, 64, 1};
    case DType::kU8: case DType::kBool: case DType::kF8E4M3: case DType::kF8E5M2: return {kDLUInt, 8, 1};
  }
  return {kDLUInt, 8, 1};
}

std::string join(const int64_t* v, int n) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < n; ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

[[noreturn]] void value_error(const std::string& name, const std::string& what) {
  throw py::value_error("tensor '" + name + "': " + what);
}

bool contiguous(const DLTensor& t) {
  if (!t.strides) return true;
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expected) return false;
    expected *= t.shape[i];
  }
  return true;
}

StatusOr<Device> device_of(const DLDevice& d) {
  if (d.device_type == kDLCPU || d.device_type == kDLCUDAHost) return Device::cpu();
  if (d.device_type == kDLCUDA) return Device::cuda(d.device_id);
  return invalid_argument("DLPack device type " + std::to_string(d.device_type) + " (ParamCast takes cpu and cuda)");
}

py::capsule capsule_of(const std::string& name, py::handle obj, std::optional<intptr_t> stream) {
  if (PyCapsule_CheckExact(obj.ptr())) return py::reinterpret_borrow<py::capsule>(obj);
  if (!py::hasattr(obj, "__dlpack__"))
    value_error(name, std::string("expected a tensor with __dlpack__ (torch, numpy, ...), got ") +
                          std::string(py::str(py::type::of(obj).attr("__name__"))));
  py::object cap = stream ? obj.attr("__dlpack__")(py::arg("stream") = *stream) : obj.attr("__dlpack__")();
  if (!PyCapsule_IsValid(cap.ptr(), kCapsuleName)) value_error(name, "__dlpack__ did not return a DLPack capsule");
  return py::reinterpret_steal<py::capsule>(cap.release());
}

// Owns an exported view's DLManagedTensor and its shape.
struct ExportContext {
  std::vector<int64_t> shape;
  DLManagedTensor managed{};
};

void delete_export(DLManagedTensor* m) { delete static_cast<ExportContext*>(m->manager_ctx); }

void capsule_destructor(PyObject* cap) {
  // A consumer that took ownership renamed the capsule "used_dltensor".
  if (!PyCapsule_IsValid(cap, kCapsuleName)) return;
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, kCapsuleName));
  if (m && m->deleter) m->deleter(m);
}

// A view lent to Python: hands out one DLPack capsule.
struct ExportedTensor {
  TensorView view;
  bool taken = false;

  py::object dlpack(py::object /*stream*/) {
    if (taken) throw py::value_error("tensor '" + view.spec.name + "': __dlpack__ was already called on this view");
    taken = true;
    auto* ctx = new ExportContext;
    ctx->shape = view.spec.shape;
    DLTensor& t = ctx->managed.dl_tensor;
    t.data = view.data;
    t.device = view.device.is_cuda() ? DLDevice{kDLCUDA, view.device.index} : DLDevice{kDLCPU, 0};
    t.ndim = static_cast<int32_t>(ctx->shape.size());
    t.dtype = to_dl(view.spec.dtype);
    t.shape = ctx->shape.data();
    t.strides = nullptr;
    t.byte_offset = 0;
    ctx->managed.manager_ctx = ctx;
    ctx->managed.deleter = delete_export;
    return py::reinterpret_steal<py::object>(PyCapsule_New(&ctx->managed, kCapsuleName, capsule_destructor));
  }

  py::tuple dlpack_device() const {
    if (view.device.is_cuda()) return py::make_tuple(static_cast<int>(kDLCUDA), view.device.index);
    return py::make_tuple(static_cast<int>(kDLCPU), 0);
  }
};

}  // namespace

BorrowedTensor import_tensor(const std::string& name, py::handle obj, const std::optional<std::string>& dtype,
                             const std::optional<Device>& expected, std::optional<intptr_t> stream) {
  py::capsule cap = capsule_of(name, obj, stream);
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap.ptr(), kCapsuleName));
  if (!m) throw py::error_already_set();
  const DLTensor& t = m->dl_tensor;
  BorrowedTensor out;
  out.view.spec.name = name;
  std::optional<DType> d = from_dl(t.dtype);
  if (dtype) {
    auto parsed = parse_dtype(*dtype);
    if (!parsed) value_error(name, "unknown ParamCast dtype '" + *dtype + "'");
    if (dtype_size(*parsed) * 8 != t.dtype.bits || t.dtype.lanes != 1)
      value_error(name, "dtype " + *dtype + " does not fit the DLPack element " + dl_dtype_string(t.dtype));
    d = parsed;
  }
  if (!d)
    value_error(name, "dtype " + dl_dtype_string(t.dtype) +
                          " is not supported; expected one of F32, F16, BF16, F64, F8_E4M3, F8_E5M2, I8, U8, I16, "
                          "I32, I64, BOOL");
  out.view.spec.dtype = *d;
  if (t.ndim < 0) value_error(name, "negative number of dimensions");
  out.view.spec.shape.assign(t.shape, t.shape + t.ndim);
  if (!contiguous(t))
    value_error(name, "expected a contiguous tensor, got shape " + join(t.shape, t.ndim) + " with strides " +
                          join(t.strides, t.ndim) + " (call .contiguous() first)");
  auto dev = device_of(t.device);
  if (!dev.ok()) value_error(name, "unsupported device: " + dev.status().message());
  if (expected && !(dev.value() == *expected))
    value_error(name, "expected a tensor on " + expected->to_string() + ", got one on " + dev.value().to_string());
  out.view.device = dev.value();
  out.view.data = static_cast<char*>(t.data) + t.byte_offset;
  out.keepalive = std::move(cap);
  return out;
}

py::object export_view(const TensorView& view) { return py::cast(ExportedTensor{view}); }

void bind_tensors(py::module_& m) {
  py::class_<ExportedTensor>(m, "TensorRef", "A ParamCast tensor lent over DLPack (valid during the callback only).")
      .def("__dlpack__", &ExportedTensor::dlpack, py::arg("stream") = py::none())
      .def("__dlpack_device__", &ExportedTensor::dlpack_device)
      .def_property_readonly("name", [](const ExportedTensor& t) { return t.view.spec.name; })
      .def_property_readonly("dtype", [](const ExportedTensor& t) { return std::string(dtype_name(t.view.spec.dtype)); })
      .def_property_readonly("shape", [](const ExportedTensor& t) { return t.view.spec.shape; });
  m.def(
      "check_tensor",
      [](const std::string& name, py::handle obj, std::optional<std::string> dtype) {
        BorrowedTensor b = import_tensor(name, obj, dtype, std::nullopt, std::nullopt);
        return py::make_tuple(std::string(dtype_name(b.view.spec.dtype)), b.view.spec.shape, b.view.device.to_string(),
                              reinterpret_cast<uintptr_t>(b.view.data));
      },
      py::arg("name"), py::arg("tensor"), py::arg("dtype") = py::none(),
      "Imports a tensor over DLPack as ParamCast would: (dtype, shape, device, data pointer); raises ValueError.");
  m.def("export_bytes_for_test", [](py::bytearray buf, const std::string& dtype, std::vector<int64_t> shape) {
    // Lends a bytearray's bytes as a ParamCast tensor (tests of the export path).
    auto d = parse_dtype(dtype);
    if (!d) throw py::value_error("unknown ParamCast dtype '" + dtype + "'");
    TensorView v;
    v.spec = {"test", *d, shape};
    auto n = v.spec.nbytes();
    if (!n.ok() || n.value() != static_cast<uint64_t>(PyByteArray_Size(buf.ptr())))
      throw py::value_error("shape and dtype do not match the buffer's size");
    v.data = PyByteArray_AsString(buf.ptr());
    return export_view(v);
  });
}

}  // namespace paramcast::python
