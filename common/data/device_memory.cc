#include "common/data/device_memory.h"

#include <cstdlib>
#include <cstring>

#include "common/data/block_pool.h"
#include "common/data/bucket_checksum.h"
#include "paramcast/build_config.h"

namespace paramcast {
#if PARAMCAST_HAVE_NCCL
namespace nccl_backend {
StatusOr<std::unique_ptr<DeviceMemory>> create_cuda_memory(int index);
}
#endif

namespace {
// Host staging: 4 KiB-aligned blocks from the pool, plain memcpy.
class HostMemory : public DeviceMemory {
 public:
  StatusOr<void*> allocate(size_t bytes) override {
    void* p = pool_.take(bytes);
    if (!p) return internal_error("cannot allocate " + std::to_string(bytes) + " bytes of staging memory");
    remember(p, bytes);
    return p;
  }
  void release(void* ptr) override {
    if (forget(ptr)) pool_.give_back(ptr);
  }
  Status copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
    return Status();
  }
  Status copy_many(const std::vector<CopyOp>& ops) override {
    for (const auto& op : ops)
      if (op.bytes) std::memcpy(op.dst, op.src, op.bytes);
    return Status();
  }
  StatusOr<uint64_t> checksum(const void* ptr, size_t bytes, Checksum kind) override {
    return host_checksum(kind, ptr, bytes);
  }

 private:
  BlockPool pool_{[](size_t n) { return std::aligned_alloc(4096, ((n + 4095) / 4096) * 4096 + 4096); },
                  [](void* p) { std::free(p); }, kStagingCacheBytes};
};
}  // namespace

StatusOr<std::unique_ptr<DeviceMemory>> create_device_memory(Device device) {
  if (!device.is_cuda()) return std::unique_ptr<DeviceMemory>(new HostMemory());
  auto resolved = resolve_device(device);
  if (!resolved.ok()) return resolved.status();
  device = *resolved;
#if PARAMCAST_HAVE_NCCL
  return nccl_backend::create_cuda_memory(device.index);
#else
  return unavailable("device " + device.to_string() + " needs a build with CUDA (PARAMCAST_WITH_NCCL)");
#endif
}

}  // namespace paramcast
