// The host side of the CUDA quantizer: checks, scratch, launches
// (fp8_kernels.cu) and the one wait an fp8 transform needs (its first
// non-finite index). Scratch and outputs are stream-ordered allocations
// (cudaMallocAsync / cudaFreeAsync): nothing here synchronizes the device,
// so a transform never waits on unrelated work (an NCCL broadcast in
// flight on another stream).
#include "common/transform/cuda/cuda_transform.h"

#include <cuda_runtime.h>

#include <optional>
#include <string>
#include <vector>

#include "common/data/device_memory.h"
#include "common/data/nccl/device_guard.h"
#include "common/data/nccl/nccl_check.h"
#include "common/transform/cuda/fp8_kernels.h"
#include "common/transform/scalar.h"

namespace paramcast::transform::cuda {
namespace {

using nccl_backend::DeviceGuard;

std::optional<Float> float_kind(DType d) {
  switch (d) {
    case DType::kF32: return Float::kF32;
    case DType::kBF16: return Float::kBF16;
    case DType::kF16: return Float::kF16;
    default: return std::nullopt;
  }
}

// Element `index` of a device tensor as float32 (for the refusal's text).
float element(const TensorView& src, int64_t index, cudaStream_t stream) {
  const size_t size = dtype_size(src.spec.dtype);
  uint32_t bits = 0;
  const auto* at = static_cast<const uint8_t*>(src.data) + static_cast<uint64_t>(index) * size;
  if (cudaMemcpyAsync(&bits, at, size, cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess) {
    cudaGetLastError();
    return scalar::float_of(0x7FC00000u);
  }
  switch (src.spec.dtype) {
    case DType::kF32: return scalar::float_of(bits);
    case DType::kF16: return scalar::f16_to_float(static_cast<uint16_t>(bits));
    default: return scalar::bf16_to_float(static_cast<uint16_t>(bits));
  }
}

// Per fp8 call: the first bad index, then `amax_count` row amaxes.
struct Scratch {
  unsigned long long* bad = nullptr;
  uint32_t* amax = nullptr;
};

}  // namespace

StatusOr<int> ordinal(const Device& device) {
  if (!device.is_cuda()) return invalid_argument(device.to_string() + " is not a CUDA device");
  auto d = resolve_device(device);
  if (!d.ok()) return d.status();
  return d->index;
}

StatusOr<uint8_t*> allocate(int device, size_t bytes) {
  DeviceGuard guard(device);
  void* p = nullptr;
  const cudaError_t e = cudaMallocAsync(&p, bytes, nullptr);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return unavailable("no device memory on cuda:" + std::to_string(device) + " for " + std::to_string(bytes) +
                       " bytes");
  }
  PC_CUDA_RETURN(e);
  return static_cast<uint8_t*>(p);
}

void release(int device, uint8_t* ptr) {
  if (!ptr) return;
  DeviceGuard guard(device);
  if (cudaFreeAsync(ptr, nullptr) != cudaSuccess) cudaGetLastError();
}

Status encode_bits(uint32_t first, uint64_t n, uint8_t* codes_device, void* stream) {
  PC_CUDA_RETURN(launch_encode_bits(first, n, codes_device, static_cast<cudaStream_t>(stream)));
  return Status();
}

Status apply(const TensorView& src, const Transform& t, void* out, float* scales, void* stream_ptr) {
  const std::string name = "tensor '" + src.spec.name + "'";
  if (!src.device.is_cuda()) return invalid_argument(name + ": the CUDA transform takes a CUDA tensor");
  auto numel = src.spec.numel();
  if (!numel.ok()) return numel.status();
  const uint64_t n = *numel;
  if (n > 0 && !src.data) return invalid_argument(name + " has no data pointer");
  if (t.kind == Transform::Kind::kFp8 && src.spec.shape.size() != 2)
    return invalid_argument(name + " " + src.spec.shape_string() + ": " + describe(t) + " takes a 2-D tensor");
  const auto from = float_kind(src.spec.dtype);
  if (t.kind != Transform::Kind::kNone && !from) {
    std::string msg = name + " (";
    msg += dtype_name(src.spec.dtype);
    msg += "): ";
    msg += describe(t);
    msg += " takes a float tensor (F32, F16, BF16)";
    return invalid_argument(msg);
  }
  const auto to = float_kind(t.to);
  if (t.kind == Transform::Kind::kCast && !to) return invalid_argument(name + ": cast goes to bf16, fp16 or fp32");
  auto device = ordinal(src.device);
  if (!device.ok()) return device.status().with_context(name);
  DeviceGuard guard(*device);
  const auto stream = static_cast<cudaStream_t>(stream_ptr);

  if (t.kind == Transform::Kind::kNone) {
    if (n) PC_CUDA_RETURN(cudaMemcpyAsync(out, src.data, n * dtype_size(src.spec.dtype), cudaMemcpyDeviceToDevice, stream));
    PC_CUDA_RETURN(cudaStreamSynchronize(stream));
    return Status();
  }
  if (t.kind == Transform::Kind::kCast) {
    PC_CUDA_RETURN(launch_cast(src.data, *from, n, out, *to, stream));
    PC_CUDA_RETURN(cudaStreamSynchronize(stream));
    return Status();
  }

  // fp8. An empty tensor has no codes; its rows (channel) or the tensor
  // have amax 0, scale 1, as on the host.
  const int64_t rows = src.spec.shape[0], cols = src.spec.shape[1];
  const int64_t scale_count = t.scaling == Fp8Scaling::kBlock     ? (rows + kBlock - 1) / kBlock * ((cols + kBlock - 1) / kBlock)
                              : t.scaling == Fp8Scaling::kChannel ? rows
                                                                  : 1;
  if (n == 0) {
    if (scale_count > 0) {
      const std::vector<float> ones(static_cast<size_t>(scale_count), 1.0f);
      PC_CUDA_RETURN(cudaMemcpyAsync(scales, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
      PC_CUDA_RETURN(cudaStreamSynchronize(stream));
    }
    return Status();
  }
  const int64_t amax_count = t.scaling == Fp8Scaling::kBlock ? 0 : scale_count;
  void* raw = nullptr;
  PC_CUDA_RETURN(cudaMallocAsync(&raw, sizeof(unsigned long long) + sizeof(uint32_t) * static_cast<size_t>(amax_count), stream));
  Scratch scratch{static_cast<unsigned long long*>(raw),
                  reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(raw) + sizeof(unsigned long long))};
  unsigned long long bad = ~0ull;
  auto queue = [&]() -> cudaError_t {
    cudaError_t e = cudaMemsetAsync(scratch.bad, 0xFF, sizeof(unsigned long long), stream);
    if (e == cudaSuccess && amax_count)
      e = cudaMemsetAsync(scratch.amax, 0, sizeof(uint32_t) * static_cast<size_t>(amax_count), stream);
    if (e != cudaSuccess) return e;
    auto* q = static_cast<uint8_t*>(out);
    switch (t.scaling) {
      case Fp8Scaling::kBlock: e = launch_fp8_block(src.data, *from, rows, cols, q, scales, scratch.bad, stream); break;
      case Fp8Scaling::kChannel:
        e = launch_fp8_rows(src.data, *from, rows, cols, q, scales, scratch.amax, scratch.bad, stream);
        break;
      default:  // the tensor as one row
        e = launch_fp8_rows(src.data, *from, 1, rows * cols, q, scales, scratch.amax, scratch.bad, stream);
    }
    if (e != cudaSuccess) return e;
    return cudaMemcpyAsync(&bad, scratch.bad, sizeof(bad), cudaMemcpyDeviceToHost, stream);
  };
  const cudaError_t queued = queue();
  const cudaError_t freed = cudaFreeAsync(raw, stream);
  PC_CUDA_RETURN(queued);
  PC_CUDA_RETURN(freed);
  PC_CUDA_RETURN(cudaStreamSynchronize(stream));
  if (bad == ~0ull) return Status();
  const auto index = static_cast<int64_t>(bad);
  return not_finite_error(src.spec, t, index, element(src, index, stream));
}

}  // namespace paramcast::transform::cuda
