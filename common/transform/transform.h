// Transforms on send: the engine receives what it serves, not what the
// trainer holds.
//
// A trainer trains in BF16 (FP32 master weights) while its engines may serve
// BF16 from an FP32 trainer, or FP8. Rules in the publisher's config
// (publisher.transforms, overridable per update: UpdateOptions::transforms)
// pick, by tensor name, what travels instead of the trainer's bytes:
//   cast: bf16 | fp16 | fp32   the same shape in another float dtype
//                              (round to nearest even, as PyTorch's .to())
//   fp8: block | channel | tensor
//                              float8 e4m3fn, plus `<name>_scale_inv` in
//                              float32: one scale per 128x128 block (the
//                              layout DeepSeek-V3 checkpoints and vLLM's
//                              block-FP8 linear layers load), per row
//                              ([rows, 1]), or one for the tensor ([1])
//   keep: true                 the tensor travels as it is (an exemption
//                              ahead of a broader rule)
// The first rule whose `match` (a glob over the whole name: `*` any run of
// characters, `?` one) matches decides; a tensor no rule matches travels as
// it is. fp8 takes a 2-D float tensor, cast a float tensor: a rule matching
// anything else is an error naming the tensor and the rule.
//
// The quantization is exact and reproducible (docs/transforms.md has the
// reference in PyTorch, which the tests check this against bit for bit):
// per block (row, tensor) of x as float32,
//   amax  = max |x|                       (a non-finite x is refused)
//   scale = amax / 448  (float32), or 1 where amax is below 448 x 2^-149
//           (amax 0 included: amax / 448 would be 0, or 2^-149 at most)
//   q     = e4m3fn(clamp(x / scale, -448, 448))   round to nearest even
//   <name>_scale_inv = scale              (x ~ q * scale_inv)
// (scalar.h holds these steps, shared by the host loops and the kernels.)
//
// A tensor in host memory is transformed here, on the calling thread. A
// CUDA tensor is transformed on its device by cuda/ (cuda/cuda_transform.h:
// the same bytes, bit for bit), into device memory, and waited on before
// apply returns; a build without CUDA refuses it.
//
// No I/O, no lock; pure for host tensors (a CUDA tensor's transform
// allocates device memory and runs kernels on the legacy default stream).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"

namespace paramcast::transform {

enum class Fp8Scaling : uint8_t { kBlock, kChannel, kTensor };
inline constexpr int64_t kBlock = 128;        // fp8: block is 128 x 128 elements
inline constexpr float kFp8Max = 448.0f;      // the largest finite e4m3fn
inline constexpr const char* kScaleSuffix = "_scale_inv";

struct Rule {
  std::string match;
  std::optional<DType> cast;        // cast: bf16 | fp16 | fp32
  std::optional<Fp8Scaling> fp8;    // fp8: block | channel | tensor
  bool keep = false;                // keep: true
  std::string where;                // for errors: "publisher.transforms[2]" (file:line in a config)
  bool operator==(const Rule& o) const { return match == o.match && cast == o.cast && fp8 == o.fp8 && keep == o.keep; }
};

// What one tensor becomes on the wire.
struct Transform {
  enum class Kind : uint8_t { kNone, kCast, kFp8 };
  Kind kind = Kind::kNone;
  DType to = DType::kF32;                  // kCast: the wire dtype
  Fp8Scaling scaling = Fp8Scaling::kBlock;  // kFp8
  int rule = -1;                            // the rule that chose it (-1: none)
  bool none() const { return kind == Kind::kNone; }
};

// Whole-name glob: `*` any run of characters (also none), `?` any one.
bool glob_match(const std::string& pattern, const std::string& name);

// The transform the first matching rule gives `spec`; an error naming the
// tensor and the rule when the rule cannot apply to it.
StatusOr<Transform> resolve(const std::vector<Rule>& rules, const TensorSpec& spec);

// What travels for `spec`: itself, the cast tensor, or the fp8 tensor and
// its scales (in that order).
std::vector<TensorSpec> wire_specs(const TensorSpec& spec, const Transform& t);
std::vector<int64_t> scale_shape(const std::vector<int64_t>& shape, Fp8Scaling scaling);

// "fp8: block" / "cast: bf16" / "as is", with the rule's place when known.
std::string describe(const Transform& t, const std::vector<Rule>& rules = {});

// Writes what travels for tensor `src` into `out` (wire_specs(...)[0]'s
// bytes) and, for fp8, `scales` (wire_specs(...)[1]'s). An error names the
// tensor and the first non-finite element's index (fp8). `out` and
// `scales` are in the memory `src` is in: host memory, or device memory of
// a CUDA tensor's device (then the work runs on the legacy default stream,
// after what is queued there, and is complete when apply returns).
Status apply(const TensorView& src, const Transform& t, void* out, float* scales);

// The refusal of a non-finite element at flat `index` (value `value`) of
// `spec` under fp8 (the host and CUDA paths say the same).
Status not_finite_error(const TensorSpec& spec, const Transform& t, int64_t index, float value);

// A buffer a transform wrote: host memory (device < 0), or device memory of
// CUDA device `device`, freed stream-ordered on the legacy default stream:
// whoever reads a CUDA Buffer on another stream (an NCCL send) must be done
// with it before the Buffer dies (cuda_transform.h, release).
struct BufferFree {
  int device = -1;
  void operator()(uint8_t* p) const;
};
using Buffer = std::unique_ptr<uint8_t[], BufferFree>;

// A whole update's tensors as they travel: views of the caller's own bytes
// where no rule applies, of buffers owned here where one does (the fp8
// tensor, then its scales, in the caller's order). A CUDA tensor's buffers
// are device memory on its device (its views name that device). Refused,
// naming the tensor: a rule that cannot apply, a scale's name that another
// tensor of the update has, a non-finite value under fp8, a CUDA tensor in
// a build without CUDA.
struct Transformed {
  std::vector<TensorView> views;
  std::vector<Buffer> owned;
  size_t transformed = 0;    // tensors a rule changed
  uint64_t owned_bytes = 0;  // host (or device) memory held for them
};
StatusOr<Transformed> apply_all(const std::vector<TensorView>& tensors, const std::vector<Rule>& rules);

// A many-sender rank's shards as they travel (Publisher::weight_update_sharded,
// PublisherRank::weight_update): each sender transforms what it holds. A
// rule applies as to the full tensor; a box of part of it takes `cast` and
// `fp8: block` when its edges fall on multiples of 128 (or the tensor's
// end: no block straddles two senders), `fp8: channel` when it holds whole
// rows; `fp8: tensor` needs the whole tensor. The scales travel as the box
// of the scale tensor the box's blocks (rows) make. Refused otherwise,
// naming the tensor, the box and why.
struct TransformedShards {
  std::vector<ShardView> views;
  std::vector<Buffer> owned;
  size_t transformed = 0;
  uint64_t owned_bytes = 0;
};
StatusOr<TransformedShards> apply_shards(const std::vector<ShardView>& shards, const std::vector<Rule>& rules);

// Why a publisher refuses transforms on CUDA tensors for now (the config's
// publisher.transforms and an update's own rules alike): the CUDA path
// above is compile-checked, and its GPU tests have not run yet. The one
// place that says so; removed once a lent GPU has run them.
inline constexpr const char* kCudaPending =
    "transforms of CUDA tensors wait for the CUDA quantizer's first run on a GPU (docs/transforms.md, \"On the "
    "GPU\"); publish from host tensors (publisher.device: cpu) to transform them";

// The scalar conversions, exposed for tests: round to nearest even.
uint8_t e4m3fn_from_float(float x);  // |x| <= 448 and finite (apply clamps first)
float e4m3fn_to_float(uint8_t code);
uint16_t bf16_from_float(float x);
uint16_t f16_from_float(float x);
float bf16_to_float(uint16_t bits);
float f16_to_float(uint16_t bits);

}  // namespace paramcast::transform
