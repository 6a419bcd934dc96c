// The host side of the CUDA quantizer: checks, scratch, launches
// (fp8_kernels.cu) and the one wait an fp8 transform needs (its first
// non-finite index). Scratch and outputs are stream-ordered allocations
// (cudaMallocAsync / cudaFreeAsync): nothing here synchronizes the device,
// so a transform never waits on unrelated work (an NCCL broadcast in
// flight on another stream).
//
// Errors: every failed runtime call becomes a Status naming the tensor and
// the call, and its error is taken off the thread (cudaGetLastError), so
// that no later CUDA check of the caller's (PyTorch's, NCCL's) reports it
// again. Out of device memory is kUnavailable wherever it happens (an
// output in allocate, the scratch in apply); a device that does not exist
// and a pointer not aligned to its elements are kInvalidArgument;
// everything else is kInternal.
#include "common/transform/cuda/cuda_transform.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/device.h"
#include "common/transform/cuda/fp8_kernels.h"
#include "common/transform/scalar.h"

namespace paramcast::transform::cuda {
namespace {

std::optional<Float> float_kind(DType d) {
  switch (d) {
    case DType::kF32: return Float::kF32;
    case DType::kBF16: return Float::kBF16;
    case DType::kF16: return Float::kF16;
    default: return std::nullopt;
  }
}

// The Status of a failed runtime call `call` (returned `e`), for `what`
// ("tensor 'w'", "cuda:0"). The thread's last error is cleared (a sticky
// error, one that broke the context, stays: CUDA keeps reporting it).
Status failure(cudaError_t e, const char* call, const std::string& what) {
  (void)cudaGetLastError();
  std::string msg = what;
  msg += ": ";
  msg += call;
  msg += ": ";
  msg += cudaGetErrorName(e);
  msg += ": ";
  msg += cudaGetErrorString(e);
  if (e == cudaErrorMemoryAllocation) return unavailable(msg);
  if (e == cudaErrorInvalidDevice || e == cudaErrorNoDevice) return invalid_argument(msg);
  return internal_error(msg);
}

// Returns the failure of `call` for `what` (a std::string) when it fails.
#define PC_TRANSFORM_CUDA(call, what)                                  \
  do {                                                                 \
    const cudaError_t pc_te_ = (call);                                 \
    if (pc_te_ != cudaSuccess) return failure(pc_te_, #call, (what));  \
  } while (0)

// Makes a device current for a scope and then makes the caller's current
// again, so that ParamCast never changes the device a trainer's thread
// works on. Unlike nccl_backend::DeviceGuard, says when the device cannot
// be made current (enter's Status), rather than running on another one.
class OnDevice {
 public:
  OnDevice() = default;
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;
  ~OnDevice() {
    if (current_ >= 0 && previous_ != current_ && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }
  Status enter(int device) {
    const std::string what = "cuda:" + std::to_string(device);
    int previous = -1;
    PC_TRANSFORM_CUDA(cudaGetDevice(&previous), what);
    previous_ = previous;
    if (previous != device) PC_TRANSFORM_CUDA(cudaSetDevice(device), what);
    current_ = device;
    return Status();
  }

 private:
  int previous_ = -1;  // the caller's device
  int current_ = -1;   // the device entered; -1: none (nothing to restore)
};

// Refuses a pointer a kernel would read or write elements of `size` bytes
// through when it is not aligned to them (a misaligned load is a sticky
// error: it would end every later CUDA call of the process).
Status check_aligned(const void* p, size_t size, const std::string& name, const char* which, std::string_view type) {
  if (size <= 1 || reinterpret_cast<uintptr_t>(p) % size == 0) return Status();
  char at[32];
  std::snprintf(at, sizeof(at), "%p", p);
  std::string msg = name;
  msg += ": ";
  msg += which;
  msg += " (";
  msg += at;
  msg += ") is not aligned to its ";
  msg += std::to_string(size);
  msg += "-byte ";
  msg += type;
  msg += " elements; the CUDA transform reads and writes whole elements";
  return invalid_argument(msg);
}

// Element `index` of a device tensor as float32 (for the refusal's text).
float element(const TensorView& src, int64_t index, cudaStream_t stream) {
  const size_t size = dtype_size(src.spec.dtype);
  uint32_t bits = 0;
  const auto* at = static_cast<const uint8_t*>(src.data) + static_cast<uint64_t>(index) * size;
  if (cudaMemcpyAsync(&bits, at, size, cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess) {
    (void)cudaGetLastError();
    return scalar::float_of(0x7FC00000u);
  }
  switch (src.spec.dtype) {
    case DType::kF32: return scalar::float_of(bits);
    case DType::kF16: return scalar::f16_to_float(static_cast<uint16_t>(bits));
    default: return scalar::bf16_to_float(static_cast<uint16_t>(bits));
  }
}

// What apply refuses before anything runs on the device: no data, a shape or
// dtype the rule does not take, a pointer not aligned to its elements.
Status check_inputs(const TensorView& src, const Transform& t, uint64_t n, const void* out, const float* scales,
                    const std::string& name) {
  if (n > 0 && !src.data) return invalid_argument(name + " has no data pointer");
  if (t.kind == Transform::Kind::kFp8 && src.spec.shape.size() != 2)
    return invalid_argument(name + " " + src.spec.shape_string() + ": " + describe(t) + " takes a 2-D tensor");
  if (t.kind != Transform::Kind::kNone && !float_kind(src.spec.dtype)) {
    std::string msg = name + " (";
    msg += dtype_name(src.spec.dtype);
    msg += "): ";
    msg += describe(t);
    msg += " takes a float tensor (F32, F16, BF16)";
    return invalid_argument(msg);
  }
  if (t.kind == Transform::Kind::kCast && !float_kind(t.to))
    return invalid_argument(name + ": cast goes to bf16, fp16 or fp32");
  if (t.kind != Transform::Kind::kNone) {  // the kernels read and write whole elements
    PC_RETURN_IF_ERROR(check_aligned(src.data, dtype_size(src.spec.dtype), name, "its data",
                                     dtype_name(src.spec.dtype)));
    if (t.kind == Transform::Kind::kCast)
      PC_RETURN_IF_ERROR(check_aligned(out, dtype_size(t.to), name, "the output buffer", dtype_name(t.to)));
    else
      PC_RETURN_IF_ERROR(check_aligned(scales, sizeof(float), name, "the scales buffer", "F32"));
  }
  return Status();
}

// Kind::kNone: the tensor's bytes as they are.
Status copy_as_is(const TensorView& src, uint64_t n, void* out, cudaStream_t stream, const std::string& name) {
  if (n)
    PC_TRANSFORM_CUDA(cudaMemcpyAsync(out, src.data, n * dtype_size(src.spec.dtype), cudaMemcpyDeviceToDevice, stream),
                      name);
  PC_TRANSFORM_CUDA(cudaStreamSynchronize(stream), name);
  return Status();
}

// Kind::kCast: each element as t.to.
Status cast(const TensorView& src, const Transform& t, uint64_t n, void* out, cudaStream_t stream,
            const std::string& name) {
  PC_TRANSFORM_CUDA(launch_cast(src.data, *float_kind(src.spec.dtype), n, out, *float_kind(t.to), stream), name);
  PC_TRANSFORM_CUDA(cudaStreamSynchronize(stream), name);
  return Status();
}

// How many scales fp8 gives a rows x cols tensor: one per block, per row
// (channel), or one for the tensor.
int64_t scale_count(const Transform& t, int64_t rows, int64_t cols) {
  return t.scaling == Fp8Scaling::kBlock     ? (rows + kBlock - 1) / kBlock * ((cols + kBlock - 1) / kBlock)
         : t.scaling == Fp8Scaling::kChannel ? rows
                                             : 1;
}

// An empty tensor has no codes; its rows (channel) or the tensor have amax
// 0, scale 1, as on the host.
Status unit_scales(float* scales, int64_t count, cudaStream_t stream, const std::string& name) {
  if (count <= 0) return Status();
  const std::vector<float> ones(static_cast<size_t>(count), 1.0f);
  PC_TRANSFORM_CUDA(cudaMemcpyAsync(scales, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice, stream),
                    name);
  PC_TRANSFORM_CUDA(cudaStreamSynchronize(stream), name);
  return Status();
}

// One fp8 transform's scratch, `bytes` of it, stream-ordered; out of device
// memory is kUnavailable.
StatusOr<void*> allocate_scratch(size_t bytes, int device, const Transform& t, cudaStream_t stream,
                                 const std::string& name) {
  void* raw = nullptr;
  if (const cudaError_t e = cudaMallocAsync(&raw, bytes, stream); e != cudaSuccess) {
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return unavailable(name + ": no device memory on cuda:" + std::to_string(device) + " for its " +
                         std::to_string(bytes) + " bytes of scratch (" + describe(t) + ")");
    }
    return failure(e, "cudaMallocAsync(scratch)", name);
  }
  return raw;
}

// Kind::kFp8: codes into `out`, the scales into `scales`; the one wait is
// for the first non-finite index, which refuses the tensor.
Status quantize_fp8(const TensorView& src, const Transform& t, uint64_t n, void* out, float* scales, int device,
                    cudaStream_t stream, const std::string& name) {
  const int64_t rows = src.spec.shape[0], cols = src.spec.shape[1];
  const int64_t count = scale_count(t, rows, cols);
  if (n == 0) return unit_scales(scales, count, stream, name);
  // Scratch: the first non-finite index, then (rows) the rows' amax bits.
  const int64_t amax_count = t.scaling == Fp8Scaling::kBlock ? 0 : count;
  const size_t scratch_bytes = sizeof(unsigned long long) + sizeof(uint32_t) * static_cast<size_t>(amax_count);
  auto scratch = allocate_scratch(scratch_bytes, device, t, stream, name);
  if (!scratch.ok()) return scratch.status();
  void* raw = *scratch;
  auto* first_bad = static_cast<unsigned long long*>(raw);
  auto* amax = reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(raw) + sizeof(unsigned long long));
  const Float from = *float_kind(src.spec.dtype);
  unsigned long long bad = ~0ull;
  // Queues the work; the first failure's Status (the rest is not queued).
  auto queue = [&]() -> Status {
    PC_TRANSFORM_CUDA(cudaMemsetAsync(first_bad, 0xFF, sizeof(unsigned long long), stream), name);
    if (amax_count)
      PC_TRANSFORM_CUDA(cudaMemsetAsync(amax, 0, sizeof(uint32_t) * static_cast<size_t>(amax_count), stream), name);
    auto* q = static_cast<uint8_t*>(out);
    switch (t.scaling) {
      case Fp8Scaling::kBlock:
        PC_TRANSFORM_CUDA(launch_fp8_block(src.data, from, rows, cols, q, scales, first_bad, stream), name);
        break;
      case Fp8Scaling::kChannel:
        PC_TRANSFORM_CUDA(launch_fp8_rows(src.data, from, rows, cols, q, scales, amax, first_bad, stream), name);
        break;
      default:  // the tensor as one row
        PC_TRANSFORM_CUDA(launch_fp8_rows(src.data, from, 1, rows * cols, q, scales, amax, first_bad, stream), name);
    }
    PC_TRANSFORM_CUDA(cudaMemcpyAsync(&bad, first_bad, sizeof(bad), cudaMemcpyDeviceToHost, stream), name);
    return Status();
  };
  const Status queued = queue();
  // Freed after what was queued, whether or not all of it was.
  const cudaError_t freed = cudaFreeAsync(raw, stream);
  // The copy of `bad` lands in this frame: wait for it before any return.
  const cudaError_t synced = cudaStreamSynchronize(stream);
  if (!queued.ok()) {
    (void)cudaGetLastError();
    return queued;
  }
  PC_TRANSFORM_CUDA(freed, name);
  PC_TRANSFORM_CUDA(synced, name);
  if (bad == ~0ull) return Status();
  const auto index = static_cast<int64_t>(bad);
  return not_finite_error(src.spec, t, index, element(src, index, stream));
}

}  // namespace

StatusOr<int> ordinal(const Device& device) {
  if (!device.is_cuda()) return invalid_argument(device.to_string() + " is not a CUDA device");
  auto d = resolve_device(device);
  if (!d.ok()) return d.status();
  return d->index;
}

StatusOr<uint8_t*> allocate(int device, size_t bytes) {
  OnDevice on;
  PC_RETURN_IF_ERROR(on.enter(device));
  void* p = nullptr;
  const cudaError_t e = cudaMallocAsync(&p, bytes, nullptr);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return unavailable("no device memory on cuda:" + std::to_string(device) + " for " + std::to_string(bytes) +
                       " bytes");
  }
  PC_TRANSFORM_CUDA(e, "cuda:" + std::to_string(device));
  return static_cast<uint8_t*>(p);
}

void release(int device, uint8_t* ptr) {
  if (!ptr) return;
  OnDevice on;
  if (!on.enter(device).ok()) return;  // the device is unreachable: its memory goes with its context
  if (cudaFreeAsync(ptr, nullptr) != cudaSuccess) (void)cudaGetLastError();
}

Status encode_bits(uint32_t first, uint64_t n, uint8_t* codes_device, void* stream) {
  PC_TRANSFORM_CUDA(launch_encode_bits(first, n, codes_device, static_cast<cudaStream_t>(stream)), "encode_bits");
  return Status();
}

Status reference_bits(uint32_t first, uint64_t n, uint8_t* codes_device, void* stream) {
  PC_TRANSFORM_CUDA(launch_reference_bits(first, n, codes_device, static_cast<cudaStream_t>(stream)),
                    "reference_bits");
  return Status();
}

Status apply(const TensorView& src, const Transform& t, void* out, float* scales, void* stream_ptr) {
  const std::string name = "tensor '" + src.spec.name + "'";
  if (!src.device.is_cuda()) return invalid_argument(name + ": the CUDA transform takes a CUDA tensor");
  auto numel = src.spec.numel();
  if (!numel.ok()) return numel.status();
  const uint64_t n = *numel;
  PC_RETURN_IF_ERROR(check_inputs(src, t, n, out, scales, name));
  auto device = ordinal(src.device);
  if (!device.ok()) return device.status().with_context(name);
  OnDevice on;
  if (Status s = on.enter(*device); !s.ok()) return s.with_context(name);
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  switch (t.kind) {
    case Transform::Kind::kNone: return copy_as_is(src, n, out, stream, name);
    case Transform::Kind::kCast: return cast(src, t, n, out, stream, name);
    default: return quantize_fp8(src, t, n, out, scales, *device, stream, name);
  }
}

}  // namespace paramcast::transform::cuda
