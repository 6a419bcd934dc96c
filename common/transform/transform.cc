#include "common/transform/transform.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <set>

#if defined(__x86_64__) || (defined(__i386__) && defined(__SSE2__))
#include <xmmintrin.h>
#endif

#include "common/transform/scalar.h"
#include "paramcast/build_config.h"
#if PARAMCAST_HAVE_NCCL
#include "common/transform/cuda/cuda_transform.h"
#endif

namespace paramcast::transform {

namespace {

using scalar::bits_of;
using scalar::encode;
using scalar::float_of;
using scalar::scale_of;

bool is_float(DType d) { return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16; }

// Element i of a host tensor of dtype `d` (F32, F16 or BF16) as float32.
float load(const void* data, DType d, uint64_t i) {
  switch (d) {
    case DType::kF32: return static_cast<const float*>(data)[i];
    case DType::kF16: return f16_to_float(static_cast<const uint16_t*>(data)[i]);
    default: return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
  }
}

std::string rule_name(const std::vector<Rule>& rules, int rule) {
  if (rule < 0 || static_cast<size_t>(rule) >= rules.size()) return "";
  const Rule& r = rules[static_cast<size_t>(rule)];
  std::string out = r.where.empty() ? "rule " + std::to_string(rule) : r.where;
  out += " (match '";
  out += r.match;
  out += "')";
  return out;
}


// max |x| over [begin, end) as the bits of |x| (they order as the values
// do, and integers compare the same under denormals-are-zero); `bad` set
// when any x is not finite (its bits are at least inf's).
template <class Load>
inline uint32_t amax_bits(const Load& load, int64_t begin, int64_t end, bool& bad) {
  uint32_t m = 0;
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t a = bits_of(load(i)) & scalar::kAbsMask;
    m = a > m ? a : m;
  }
  bad = bad || m >= scalar::kInfBits;
  return m;
}

template <class Load>
inline void quantize_run(const Load& load, int64_t begin, int64_t end, float scale, uint8_t* q) {
  for (int64_t i = begin; i < end; ++i) q[i] = encode(load(i) / scale);
}

// Returns the flat index of the first non-finite element, or -1 (written).
template <class Load>
int64_t fp8_kernel(const Load& load, int64_t rows, int64_t cols, Fp8Scaling scaling, uint8_t* q, float* scales) {
  bool bad = false;
  auto first_bad = [&] {
    for (int64_t i = 0; i < rows * cols; ++i)
      if (!std::isfinite(load(i))) return i;
    return int64_t{-1};
  };
  if (scaling == Fp8Scaling::kTensor) {
    const float s = scale_of(float_of(amax_bits(load, 0, rows * cols, bad)));
    if (bad) return first_bad();
    scales[0] = s;
    quantize_run(load, 0, rows * cols, s, q);
    return -1;
  }
  if (scaling == Fp8Scaling::kChannel) {
    for (int64_t r = 0; r < rows; ++r) scales[r] = scale_of(float_of(amax_bits(load, r * cols, (r + 1) * cols, bad)));
    if (bad) return first_bad();
    for (int64_t r = 0; r < rows; ++r) quantize_run(load, r * cols, (r + 1) * cols, scales[r], q);
    return -1;
  }
  const int64_t bcols = (cols + kBlock - 1) / kBlock;
  std::vector<uint32_t> amax(static_cast<size_t>(bcols));  // |x|'s bits
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {  // one stripe of 128 rows at a time
    const int64_t r1 = std::min(rows, r0 + kBlock);
    std::fill(amax.begin(), amax.end(), 0u);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < bcols; ++b) {
        const uint32_t m = amax_bits(load, r * cols + b * kBlock, r * cols + std::min(cols, (b + 1) * kBlock), bad);
        amax[static_cast<size_t>(b)] = std::max(amax[static_cast<size_t>(b)], m);
      }
    if (bad) return first_bad();
    float* row_scales = scales + (r0 / kBlock) * bcols;
    for (int64_t b = 0; b < bcols; ++b) row_scales[b] = scale_of(float_of(amax[static_cast<size_t>(b)]));
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < bcols; ++b)
        quantize_run(load, r * cols + b * kBlock, r * cols + std::min(cols, (b + 1) * kBlock), row_scales[b], q);
  }
  return -1;
}

}  // namespace

bool glob_match(const std::string& pattern, const std::string& name) {
  size_t p = 0, n = 0, star = std::string::npos, mark = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = n;
    } else if (star != std::string::npos) {
      p = star + 1;
      n = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

StatusOr<Transform> resolve(const std::vector<Rule>& rules, const TensorSpec& spec) {
  for (size_t i = 0; i < rules.size(); ++i) {
    const Rule& r = rules[i];
    if (!glob_match(r.match, spec.name)) continue;
    Transform t;
    t.rule = static_cast<int>(i);
    if (r.keep) return t;
    auto refuse = [&](const std::string& why) {
      std::string msg = "tensor '" + spec.name + "' " + spec.shape_string() + " (";
      msg += dtype_name(spec.dtype);
      msg += "): ";
      msg += why;
      msg += "; ";
      msg += rule_name(rules, static_cast<int>(i));
      msg += " matches it (exempt it with keep: true ahead of that rule)";
      return invalid_argument(msg);
    };
    if (!is_float(spec.dtype))
      return refuse(r.fp8 ? "fp8 takes a float tensor (F32, F16, BF16)" : "cast takes a float tensor (F32, F16, BF16)");
    if (r.fp8) {
      if (spec.shape.size() != 2) return refuse("fp8 takes a 2-D tensor (a weight matrix)");
      t.kind = Transform::Kind::kFp8;
      t.to = DType::kF8E4M3;
      t.scaling = *r.fp8;
      return t;
    }
    if (r.cast) {
      if (!is_float(*r.cast)) return refuse("cast goes to bf16, fp16 or fp32");
      if (*r.cast == spec.dtype) return t;  // already what the engine serves
      t.kind = Transform::Kind::kCast;
      t.to = *r.cast;
      return t;
    }
    return t;
  }
  return Transform{};
}

std::vector<int64_t> scale_shape(const std::vector<int64_t>& shape, Fp8Scaling scaling) {
  const int64_t rows = shape.size() == 2 ? shape[0] : 0, cols = shape.size() == 2 ? shape[1] : 0;
  switch (scaling) {
    case Fp8Scaling::kBlock: return {(rows + kBlock - 1) / kBlock, (cols + kBlock - 1) / kBlock};
    case Fp8Scaling::kChannel: return {rows, 1};
    default: return {1};
  }
}

std::vector<TensorSpec> wire_specs(const TensorSpec& spec, const Transform& t) {
  switch (t.kind) {
    case Transform::Kind::kNone: return {spec};
    case Transform::Kind::kCast: return {TensorSpec{spec.name, t.to, spec.shape}};
    default:
      return {TensorSpec{spec.name, DType::kF8E4M3, spec.shape},
              TensorSpec{spec.name + kScaleSuffix, DType::kF32, scale_shape(spec.shape, t.scaling)}};
  }
}

std::string describe(const Transform& t, const std::vector<Rule>& rules) {
  std::string out;
  switch (t.kind) {
    case Transform::Kind::kNone: out = "as is"; break;
    case Transform::Kind::kCast:
      out = "cast: ";
      out += dtype_name(t.to);
      break;
    default:
      out = t.scaling == Fp8Scaling::kBlock ? "fp8: block" : t.scaling == Fp8Scaling::kChannel ? "fp8: channel"
                                                                                              : "fp8: tensor";
  }
  if (const std::string r = rule_name(rules, t.rule); !r.empty() && !t.none()) out += " by " + r;
  return out;
}

// ------------------------------------------------------------ scalars
uint8_t e4m3fn_from_float(float x) { return encode(x); }

float e4m3fn_to_float(uint8_t code) {
  const float sign = (code & 0x80) ? -1.0f : 1.0f;
  const int e = (code >> 3) & 0xF, m = code & 7;
  if (e == 15 && m == 7) return std::nanf("");
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -9);
  return sign * std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
}

uint16_t bf16_from_float(float x) { return scalar::bf16_from_float(x); }
float bf16_to_float(uint16_t bits) { return scalar::bf16_to_float(bits); }
uint16_t f16_from_float(float f) { return scalar::f16_from_float(f); }
float f16_to_float(uint16_t h) { return scalar::f16_to_float(h); }

// ------------------------------------------------------------ apply
namespace {

// For a scope: the calling thread computes float32 with subnormals, as IEEE
// 754 and the CUDA kernels do, whatever mode the process left it in. A
// thread running with denormals-are-zero (a subnormal input read as 0) or
// flush-to-zero (a subnormal result written as 0), as after
// torch.set_flush_denormal(True) or loading a library built with
// -ffast-math, would otherwise get other scales and codes for blocks whose
// amax is tiny (amax 1e-40: scale 0 and every code +-448). Saves the
// thread's control register, clears those two modes, and puts the saved
// register back at scope exit. x86: MXCSR's DAZ (bit 6) and FTZ (bit 15).
// AArch64: FPCR's FZ (bit 24) and FIZ (bit 0, flush inputs; RES0 before
// FEAT_AFP, where clearing it changes nothing). Elsewhere nothing is
// changed (no such mode in use that ParamCast knows of).
class KeepSubnormals {
 public:
#if defined(__x86_64__) || (defined(__i386__) && defined(__SSE2__))
  static constexpr unsigned kFlushModes = 0x8040u;
  KeepSubnormals() : saved_(_mm_getcsr()) {
    if (saved_ & kFlushModes) _mm_setcsr(saved_ & ~kFlushModes);
  }
  ~KeepSubnormals() {
    if (saved_ & kFlushModes) _mm_setcsr(saved_);
  }

 private:
  unsigned saved_;
#elif defined(__aarch64__)
  static constexpr uint64_t kFlushModes = (uint64_t{1} << 24) | uint64_t{1};
  KeepSubnormals() {
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    if (saved_ & kFlushModes) {
      const uint64_t exact = saved_ & ~kFlushModes;
      asm volatile("msr fpcr, %0" : : "r"(exact));
    }
  }
  ~KeepSubnormals() {
    if (saved_ & kFlushModes) asm volatile("msr fpcr, %0" : : "r"(saved_));
  }

 private:
  uint64_t saved_ = 0;
#else
  KeepSubnormals() {}
#endif
 public:
  KeepSubnormals(const KeepSubnormals&) = delete;
  KeepSubnormals& operator=(const KeepSubnormals&) = delete;
};

// apply for a host tensor. Not inlined: its float operations then cannot be
// moved across the mode change around the call in apply (the compiler does
// not see the control register as an input of float arithmetic).
[[gnu::noinline]] Status apply_host(const TensorView& src, const Transform& t, void* out, float* scales);

}  // namespace

Status apply(const TensorView& src, const Transform& t, void* out, float* scales) {
  if (src.device.is_cuda()) {
#if PARAMCAST_HAVE_NCCL
    return cuda::apply(src, t, out, scales, nullptr);
#else
    std::string msg = "tensor '" + src.spec.name + "': " + describe(t);
    msg += " of a ";
    msg += src.device.to_string();
    msg += " tensor runs on the GPU, and this build has no CUDA (PARAMCAST_WITH_NCCL)";
    return invalid_argument(msg);
#endif
  }
  const KeepSubnormals exact;
  return apply_host(src, t, out, scales);
}

namespace {

Status apply_host(const TensorView& src, const Transform& t, void* out, float* scales) {
  auto numel = src.spec.numel();
  if (!numel.ok()) return numel.status();
  const uint64_t n = *numel;
  if (n > 0 && !src.data) return invalid_argument("tensor '" + src.spec.name + "' has no data pointer");
  if (t.kind == Transform::Kind::kFp8 && src.spec.shape.size() != 2)
    return invalid_argument("tensor '" + src.spec.name + "' " + src.spec.shape_string() + ": " + describe(t) +
                            " takes a 2-D tensor");
  const DType from = src.spec.dtype;
  if (t.kind == Transform::Kind::kNone) {
    std::memcpy(out, src.data, n * dtype_size(from));
    return Status();
  }
  if (t.kind == Transform::Kind::kCast) {
    for (uint64_t i = 0; i < n; ++i) {
      const float v = load(src.data, from, i);
      switch (t.to) {
        case DType::kF32: static_cast<float*>(out)[i] = v; break;
        case DType::kF16: static_cast<uint16_t*>(out)[i] = f16_from_float(v); break;
        default: static_cast<uint16_t*>(out)[i] = bf16_from_float(v); break;
      }
    }
    return Status();
  }
  // fp8: rows x cols in groups that share a scale, one kernel per source dtype.
  const int64_t rows = src.spec.shape[0], cols = src.spec.shape[1];
  int64_t bad = -1;
  switch (from) {
    case DType::kF32:
      bad = fp8_kernel([p = static_cast<const float*>(src.data)](int64_t i) { return p[i]; }, rows, cols, t.scaling,
                       static_cast<uint8_t*>(out), scales);
      break;
    case DType::kBF16:
      bad = fp8_kernel([p = static_cast<const uint16_t*>(src.data)](int64_t i) { return bf16_to_float(p[i]); }, rows,
                       cols, t.scaling, static_cast<uint8_t*>(out), scales);
      break;
    default:
      bad = fp8_kernel([p = static_cast<const uint16_t*>(src.data)](int64_t i) { return f16_to_float(p[i]); }, rows,
                       cols, t.scaling, static_cast<uint8_t*>(out), scales);
  }
  if (bad < 0) return Status();
  return not_finite_error(src.spec, t, bad, load(src.data, from, static_cast<uint64_t>(bad)));
}

}  // namespace

Status not_finite_error(const TensorSpec& spec, const Transform& t, int64_t index, float value) {
  const int64_t c = spec.shape.size() == 2 ? std::max<int64_t>(spec.shape[1], 1) : 1;
  std::string msg = "tensor '" + spec.name + "': element [";
  msg += std::to_string(index / c);
  msg += ", ";
  msg += std::to_string(index % c);
  msg += "] is not finite (";
  msg += std::to_string(value);
  msg += "): ";
  msg += describe(t);
  msg += " cannot scale it; nothing was sent";
  return invalid_argument(msg);
}

void BufferFree::operator()(uint8_t* p) const {
  if (device < 0) {
    delete[] p;
    return;
  }
#if PARAMCAST_HAVE_NCCL
  cuda::release(device, p);
#endif
}

namespace {

// An output buffer of `bytes` in the memory `like` is in (host, or its CUDA
// device); `what` names it in the error.
StatusOr<Buffer> allocate_like(const Device& like, uint64_t bytes, const std::string& what) {
  if (!like.is_cuda()) {
    try {
      return Buffer(new uint8_t[std::max<uint64_t>(bytes, 1)]);
    } catch (const std::bad_alloc&) {
      return unavailable(what + ": no host memory for its " + std::to_string(bytes) + " bytes");
    }
  }
#if PARAMCAST_HAVE_NCCL
  auto device = cuda::ordinal(like);
  if (!device.ok()) return device.status().with_context(what);
  auto p = cuda::allocate(*device, std::max<uint64_t>(bytes, 1));
  if (!p.ok()) return p.status().with_context(what);
  return Buffer(*p, BufferFree{*device});
#else
  return invalid_argument(what + ": " + like.to_string() +
                          " tensors are transformed on the GPU, and this build has no CUDA (PARAMCAST_WITH_NCCL)");
#endif
}

}  // namespace

StatusOr<Transformed> apply_all(const std::vector<TensorView>& tensors, const std::vector<Rule>& rules) {
  Transformed out;
  std::set<std::string> names;
  for (const auto& t : tensors) names.insert(t.spec.name);
  for (const auto& t : tensors) {
    auto how = resolve(rules, t.spec);
    if (!how.ok()) return how.status();
    if (how->none()) {
      out.views.push_back(t);
      continue;
    }
    const auto specs = wire_specs(t.spec, *how);
    if (specs.size() > 1 && names.count(specs[1].name))
      return invalid_argument("tensor '" + t.spec.name + "': " + describe(*how, rules) + " sends its scales as '" +
                              specs[1].name + "', which is also a tensor of this update");
    std::vector<uint8_t*> buffers;
    for (const auto& spec : specs) {
      auto bytes = spec.nbytes();
      if (!bytes.ok()) return bytes.status();
      auto buffer = allocate_like(t.device, *bytes, "tensor '" + spec.name + "' (" + describe(*how) + ")");
      if (!buffer.ok()) return buffer.status();
      out.owned.push_back(std::move(buffer.value()));
      out.owned_bytes += *bytes;
      buffers.push_back(out.owned.back().get());
      out.views.push_back(TensorView{spec, buffers.back(), t.device.is_cuda() ? t.device : Device::cpu()});
    }
    PC_RETURN_IF_ERROR(apply(t, *how, buffers[0], buffers.size() > 1 ? reinterpret_cast<float*>(buffers[1]) : nullptr));
    ++out.transformed;
  }
  return out;
}

StatusOr<TransformedShards> apply_shards(const std::vector<ShardView>& shards, const std::vector<Rule>& rules) {
  TransformedShards out;
  std::set<std::string> names;
  for (const auto& s : shards) names.insert(s.local.spec.name);
  for (const auto& s : shards) {
    TensorSpec full = s.local.spec;
    if (!s.full_shape.empty()) full.shape = s.full_shape;
    auto how = resolve(rules, full);
    if (!how.ok()) return how.status();
    if (how->none()) {
      out.views.push_back(s);
      continue;
    }
    const auto specs = wire_specs(full, *how);
    if (specs.size() > 1 && names.count(specs[1].name))
      return invalid_argument("tensor '" + full.name + "': " + describe(*how, rules) + " sends its scales as '" +
                              specs[1].name + "', which is also a tensor of this update");
    const std::vector<int64_t> offsets = s.offsets.empty() ? std::vector<int64_t>(full.shape.size(), 0) : s.offsets;
    const std::vector<int64_t>& lengths = s.local.spec.shape;
    bool bad_box = offsets.size() != full.shape.size() || lengths.size() != full.shape.size();
    for (size_t d = 0; !bad_box && d < lengths.size(); ++d)
      bad_box = offsets[d] < 0 || lengths[d] < 0 || offsets[d] > full.shape[d] || lengths[d] > full.shape[d] - offsets[d];
    if (bad_box)
      return invalid_argument("shard of '" + full.name + "': its box (" + std::to_string(offsets.size()) +
                              " offsets, local shape " + s.local.spec.shape_string() + ") is not inside " +
                              full.shape_string());
    bool empty = false;
    for (int64_t l : lengths) empty = empty || l == 0;
    // The box's scales (fp8): where they sit in the scale tensor.
    std::vector<int64_t> scale_offsets, scale_lengths;
    if (how->kind == Transform::Kind::kFp8 && !empty) {
      const int64_t R = full.shape[0], C = full.shape[1];
      const int64_t r0 = offsets[0], c0 = offsets[1], lr = lengths[0], lc = lengths[1];
      const bool whole = r0 == 0 && c0 == 0 && lr == R && lc == C;
      std::string why;
      if (how->scaling == Fp8Scaling::kTensor && !whole) {
        why = "fp8: tensor scales by the whole tensor's amax, and this rank holds part of it";
      } else if (how->scaling == Fp8Scaling::kChannel) {
        if (c0 != 0 || lc != C) why = "fp8: channel scales whole rows, and this rank holds part of each row";
        scale_offsets = {r0, 0};
        scale_lengths = {lr, 1};
      } else if (how->scaling == Fp8Scaling::kBlock) {
        auto aligned = [](int64_t at, int64_t len, int64_t end) {
          return at % kBlock == 0 && (at + len == end || len % kBlock == 0);
        };
        if (!aligned(r0, lr, R) || !aligned(c0, lc, C))
          why = "fp8: block needs a shard's edges on multiples of 128 (or the tensor's end): a block would "
                "straddle two senders";
        scale_offsets = {r0 / kBlock, c0 / kBlock};
        scale_lengths = {(lr + kBlock - 1) / kBlock, (lc + kBlock - 1) / kBlock};
      } else {
        scale_offsets = {0};
        scale_lengths = {1};
      }
      if (!why.empty()) {
        std::string box = "rows [" + std::to_string(r0) + ", " + std::to_string(r0 + lr) + ") cols [" +
                          std::to_string(c0) + ", " + std::to_string(c0 + lc) + ")";
        return invalid_argument("shard of '" + full.name + "' " + box + " of " + full.shape_string() + ": " + why +
                                " (" + describe(*how, rules) + ")");
      }
    }
    // The box itself, transformed as a tensor of its own: block-aligned, its
    // blocks (rows) are the full tensor's.
    TensorView local = s.local;
    local.spec.name = full.name;
    const auto local_specs = wire_specs(local.spec, *how);
    std::vector<uint8_t*> buffers;
    for (size_t k = 0; k < local_specs.size(); ++k) {
      if (k == 1 && empty) break;  // holds nothing of it: no scales either
      auto bytes = local_specs[k].nbytes();
      if (!bytes.ok()) return bytes.status();
      auto buffer = allocate_like(s.local.device, *bytes, "shard of '" + full.name + "' (" + describe(*how) + ")");
      if (!buffer.ok()) return buffer.status();
      out.owned.push_back(std::move(buffer.value()));
      out.owned_bytes += *bytes;
      buffers.push_back(out.owned.back().get());
      ShardView v;
      v.local = TensorView{local_specs[k], buffers.back(), s.local.device.is_cuda() ? s.local.device : Device::cpu()};
      v.local.spec.name = specs[k].name;
      v.full_shape = specs[k].shape;
      v.offsets = k == 0 ? offsets : scale_offsets;
      if (k == 1) v.local.spec.shape = scale_lengths;
      out.views.push_back(std::move(v));
    }
    if (!empty)
      PC_RETURN_IF_ERROR(apply(local, *how, buffers[0], buffers.size() > 1 ? reinterpret_cast<float*>(buffers[1]) : nullptr));
    ++out.transformed;
  }
  return out;
}

}  // namespace paramcast::transform
