// DeviceGuard: makes a CUDA device current for a scope and restores the
// caller's current device afterwards, so that ParamCast's CUDA calls never
// change the device a trainer's or engine's thread works on.
#pragma once

#include <cuda_runtime.h>

namespace paramcast::nccl_backend {

class DeviceGuard {
 public:
  explicit DeviceGuard(int index) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ != index) cudaSetDevice(index);
  }
  ~DeviceGuard() {
    int now = -1;
    if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace paramcast::nccl_backend
