// The shm ring's slots in CUDA memory, shared through CUDA IPC (slots.h).
#include <cuda_runtime.h>

#include <cstring>

#include "common/data/nccl/device_guard.h"
#include "common/data/nccl/nccl_check.h"
#include "common/data/shm/slots.h"

namespace paramcast::shm_backend {
namespace {

using nccl_backend::DeviceGuard;

class CudaSlots : public Slots {
 public:
  CudaSlots(int device, bool root) : device_(device), root_(root) {}
  ~CudaSlots() override {
    DeviceGuard g(device_);
    if (stream_) cudaStreamSynchronize(stream_);
    for (void* p : slot_)
      if (p) root_ ? cudaFree(p) : cudaIpcCloseMemHandle(p);
    if (caller_done_) cudaEventDestroy(caller_done_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  Status init() {
    DeviceGuard g(device_);
    PC_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    PC_CUDA_RETURN(cudaEventCreateWithFlags(&caller_done_, cudaEventDisableTiming));
    return Status();
  }
  Status make(ShmHeader& h) {
    DeviceGuard g(device_);
    for (int s = 0; s < kSlots; ++s) {
      PC_CUDA_RETURN(cudaMalloc(&slot_[s], h.slot_bytes));
      cudaIpcMemHandle_t handle;
      PC_CUDA_RETURN(cudaIpcGetMemHandle(&handle, slot_[s]));
      static_assert(sizeof(handle) <= sizeof(h.ipc[s]));
      std::memcpy(h.ipc[s], &handle, sizeof handle);
    }
    h.cuda = 1;
    return Status();
  }
  Status open(const ShmHeader& h) {
    DeviceGuard g(device_);
    for (int s = 0; s < kSlots; ++s) {
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, h.ipc[s], sizeof handle);
      PC_CUDA_RETURN(cudaIpcOpenMemHandle(&slot_[s], handle, cudaIpcMemLazyEnablePeerAccess));
    }
    return Status();
  }
  Status put(uint64_t chunk, const uint8_t* src, size_t len) override {
    DeviceGuard g(device_);
    PC_CUDA_RETURN(cudaMemcpyAsync(slot_[chunk % kSlots], src, len, cudaMemcpyDefault, stream_));
    PC_CUDA_RETURN(cudaStreamSynchronize(stream_));
    return Status();
  }
  Status get(uint64_t chunk, uint8_t* dst, size_t len) override {
    DeviceGuard g(device_);
    PC_CUDA_RETURN(cudaMemcpyAsync(dst, slot_[chunk % kSlots], len, cudaMemcpyDefault, stream_));
    PC_CUDA_RETURN(cudaStreamSynchronize(stream_));
    return Status();
  }
  Status order_after(void* stream) override {
    DeviceGuard g(device_);
    cudaStream_t caller = stream ? static_cast<cudaStream_t>(stream) : cudaStreamLegacy;
    PC_CUDA_RETURN(cudaEventRecord(caller_done_, caller));
    PC_CUDA_RETURN(cudaStreamWaitEvent(stream_, caller_done_, 0));
    return Status();
  }

 private:
  int device_;
  bool root_;
  void* slot_[kSlots] = {nullptr, nullptr};
  cudaStream_t stream_ = nullptr;
  cudaEvent_t caller_done_ = nullptr;
};

}  // namespace

StatusOr<std::unique_ptr<Slots>> cuda_root_slots(ShmHeader& header, Device device) {
  auto s = std::make_unique<CudaSlots>(device.index, true);
  PC_RETURN_IF_ERROR(s->init());
  PC_RETURN_IF_ERROR(s->make(header));
  return std::unique_ptr<Slots>(std::move(s));
}

StatusOr<std::unique_ptr<Slots>> cuda_reader_slots(const ShmHeader& header, Device device) {
  if (!header.cuda) return invalid_argument("the shm segment holds host slots, this rank receives into " +
                                            device.to_string());
  auto s = std::make_unique<CudaSlots>(device.index, false);
  PC_RETURN_IF_ERROR(s->init());
  PC_RETURN_IF_ERROR(s->open(header));
  return std::unique_ptr<Slots>(std::move(s));
}

}  // namespace paramcast::shm_backend
