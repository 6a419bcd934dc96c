// Slots: where the shm ring's two chunks live and how bytes go in and out.
//
//  - host memory: the slots follow the segment's header in the memfd; in
//    and out are memcpy.
//  - CUDA memory (engines on the trainer's GPU, or a GPU it can reach
//    peer to peer): the root allocates the two slots on its device once per
//    epoch and exports them with CUDA IPC memory handles, written in the
//    segment's header; each reader opens them once. In: a device-to-device
//    copy on the root's stream, complete before put() returns (so that the
//    chunk is whole when published); out: a device-to-device copy on the
//    reader's stream, complete before get() returns (so that the slot may
//    be reused once consumed). The root's copies wait for the caller's
//    stream (order_after).
//
// Thread-safety: one thread (the communicator's runner), but order_after.
#pragma once

#include <memory>

#include "common/data/shm/segment.h"
#include "common/status.h"
#include "common/tensor.h"

namespace paramcast::shm_backend {

class Slots {
 public:
  virtual ~Slots() = default;
  // Root: chunk `chunk` (len bytes from src) into its slot, complete.
  virtual Status put(uint64_t chunk, const uint8_t* src, size_t len) = 0;
  // Reader: chunk `chunk` out of its slot into dst, complete.
  virtual Status get(uint64_t chunk, uint8_t* dst, size_t len) = 0;
  // Root: later puts wait for everything queued on `stream` (CUDA).
  virtual Status order_after(void* stream) {
    (void)stream;
    return Status();
  }
};

std::unique_ptr<Slots> host_slots(const Segment& segment);

// CUDA (a build with CUDA only): the root makes and exports the slots into
// `header` before any reader attaches; a reader opens what the header holds.
StatusOr<std::unique_ptr<Slots>> cuda_root_slots(ShmHeader& header, Device device);
StatusOr<std::unique_ptr<Slots>> cuda_reader_slots(const ShmHeader& header, Device device);

}  // namespace paramcast::shm_backend
