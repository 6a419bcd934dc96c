#include "common/device.h"

#include <cctype>
#include <string>

#include "paramcast/build_config.h"

#if PARAMCAST_HAVE_NCCL
#include <cuda_runtime.h>
#endif

namespace paramcast {

#if PARAMCAST_HAVE_NCCL
namespace {

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (nvidia-smi's form) of device i.
std::string uuid_of(int i) {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) {
    cudaGetLastError();
    return "";
  }
  std::string s = "GPU-";
  static const char* hex = "0123456789abcdef";
  for (int b = 0; b < 16; ++b) {
    if (b == 4 || b == 6 || b == 8 || b == 10) s += '-';
    const auto v = static_cast<unsigned char>(prop.uuid.bytes[b]);
    s += hex[v >> 4];
    s += hex[v & 15];
  }
  return s;
}

StatusOr<Device> cuda_device_by_uuid(const std::string& uuid) {
  auto lower = [](std::string s) {
    for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  };
  const std::string want = lower(uuid.substr(4));  // without GPU- / MIG-
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
  std::string seen;
  for (int i = 0; i < count; ++i) {
    const std::string u = uuid_of(i);
    if (u.size() > 4 && lower(u.substr(4)) == want) return Device::cuda(i);
    seen += (seen.empty() ? "" : ", ") + u + " (cuda:" + std::to_string(i) + ")";
  }
  return unavailable("no visible CUDA device has UUID " + uuid + "; this process sees " + std::to_string(count) +
                     (count ? ": " + seen : std::string()) + " (CUDA_VISIBLE_DEVICES limits and renumbers them)");
}

}  // namespace
#endif

StatusOr<Device> resolve_device(const Device& device) {
  if (!device.is_cuda() || device.uuid.empty()) return device;
#if PARAMCAST_HAVE_NCCL
  return cuda_device_by_uuid(device.uuid);
#else
  return unavailable("device " + device.to_string() + " needs a build with CUDA (PARAMCAST_WITH_NCCL)");
#endif
}

Device resolve_device_or_keep(const Device& device) {
  auto d = resolve_device(device);
  return d.ok() ? *d : device;
}

}  // namespace paramcast
