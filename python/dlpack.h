// The DLPack structures ParamCast exchanges with Python frameworks.
//
// DLPack (https://github.com/dmlc/dlpack) is a stable C ABI; these are the
// fields of its v0.8 header that ParamCast reads and writes, declared here so
// that the build needs no framework headers. Capsules carrying a
// DLManagedTensor are named "dltensor"; a consumer that takes ownership
// renames them "used_dltensor".
#pragma once

#include <cstdint>

namespace paramcast::python {

enum DLDeviceType : int32_t { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13 };

enum DLDataTypeCode : uint8_t {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLBfloat = 4,
  kDLBool = 6,
  // DLPack 1.0 fp8 codes.
  kDLFloat8_e4m3fn = 10,
  kDLFloat8_e5m2 = 12,
};

struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};

struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means compact row-major
  uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

}  // namespace paramcast::python
