// Tensor descriptions shared by the trainer and inference sides.
//
// DType names follow safetensors ("F32", "BF16", "F8_E4M3", ...). TensorSpec is
// the metadata that travels in an update plan; TensorView is a non-owning
// pointer to one tensor's bytes on a device. Bytes are moved bitwise: bf16 and
// fp8 travel as bytes, nothing is converted.
//
// Thread-safety: plain values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace paramcast {

enum class DType : uint8_t {
  kF32 = 0, kF16, kBF16, kF8E4M3, kF8E5M2, kI8, kU8, kI16, kI32, kI64, kBool, kF64,
};
inline constexpr int kNumDTypes = 12;

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);  // safetensors spelling
std::optional<DType> parse_dtype(std::string_view name);
std::vector<DType> all_dtypes();

// Where a tensor's bytes live: host memory or one CUDA device.
struct Device {
  enum class Kind : uint8_t { kCpu = 0, kCuda = 1 };
  Kind kind = Kind::kCpu;
  int index = 0;  // CUDA ordinal; 0 for cpu
  // A GPU named by UUID ("GPU-..." or "MIG-..." as nvidia-smi -L prints it),
  // resolved to the ordinal the process sees by resolve_device()
  // (common/device.h). Empty when named by ordinal.
  std::string uuid;

  static Device cpu() { return {}; }
  static Device cuda(int index) { return {Kind::kCuda, index, {}}; }
  bool is_cuda() const { return kind == Kind::kCuda; }
  std::string to_string() const;
  bool operator==(const Device&) const = default;
};

// Parses "cpu", "cuda", "cuda:N", "cuda:GPU-<uuid>", "cuda:MIG-<uuid>".
StatusOr<Device> parse_device(std::string_view text);

struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;

  // Number of elements and bytes, with overflow and negative-dimension checks.
  StatusOr<uint64_t> numel() const;
  StatusOr<uint64_t> nbytes() const;
  std::string shape_string() const;  // "[4096, 11008]"
  std::string type_string() const;   // "BF16[4096,11008]": dtype and shape, as a refusal names them
  bool operator==(const TensorSpec&) const = default;
};

// A tensor's bytes on a device, not owned. For CUDA devices `data` is a device
// pointer. The view must stay valid for the duration of the call it is given to.
struct TensorView {
  TensorSpec spec;
  void* data = nullptr;
  Device device;
};

// The part of a tensor one trainer rank holds, for a many-sender update
// (Publisher::weight_update_sharded, PublisherRank::weight_update): `local`
// is a row-major buffer of the box whose first index is `offsets` and whose
// lengths are local.spec.shape, inside the full tensor of `full_shape`
// (local.spec.name and dtype are the full tensor's). A whole tensor is a
// box at offset 0 with the full shape (`offsets` empty and `full_shape`
// empty mean that too). An FSDP2 Shard(0) is the rows [a, b); a
// Megatron-style Shard(1) the columns.
struct ShardView {
  TensorView local;
  std::vector<int64_t> full_shape;
  std::vector<int64_t> offsets;
};

// Checked a * b and a + b on sizes.
std::optional<uint64_t> checked_mul(uint64_t a, uint64_t b);
std::optional<uint64_t> checked_add(uint64_t a, uint64_t b);

}  // namespace paramcast
