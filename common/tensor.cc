#include "common/tensor.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <limits>

namespace paramcast {
namespace {
struct DTypeInfo {
  std::string_view name;
  size_t size;
};
constexpr DTypeInfo kInfo[kNumDTypes] = {
    {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"I8", 1},
    {"U8", 1},  {"I16", 2}, {"I32", 4},  {"I64", 8},     {"BOOL", 1},    {"F64", 8},
};
}  // namespace

size_t dtype_size(DType dtype) { return kInfo[static_cast<int>(dtype)].size; }
std::string_view dtype_name(DType dtype) { return kInfo[static_cast<int>(dtype)].name; }

std::optional<DType> parse_dtype(std::string_view name) {
  for (int i = 0; i < kNumDTypes; ++i)
    if (kInfo[i].name == name) return static_cast<DType>(i);
  return std::nullopt;
}

std::vector<DType> all_dtypes() {
  std::vector<DType> out;
  for (int i = 0; i < kNumDTypes; ++i) out.push_back(static_cast<DType>(i));
  return out;
}

std::string Device::to_string() const {
  if (!is_cuda()) return "cpu";
  return "cuda:" + (uuid.empty() ? std::to_string(index) : uuid);
}

StatusOr<Device> parse_device(std::string_view text) {
  if (text == "cpu") return Device::cpu();
  if (text == "cuda") return Device::cuda(0);
  if (text.starts_with("cuda:")) {
    std::string_view num = text.substr(5);
    int index = -1;
    auto [p, ec] = std::from_chars(num.data(), num.data() + num.size(), index);
    if (ec == std::errc() && p == num.data() + num.size() && index >= 0 && !num.empty())
      return Device::cuda(index);
    const bool named = num.starts_with("GPU-") || num.starts_with("MIG-");
    const bool clean = num.size() > 4 && num.size() <= 96 && std::all_of(num.begin() + 4, num.end(), [](char c) {
      return std::isxdigit(static_cast<unsigned char>(c)) || c == '-' || c == '/';
    });
    if (named && clean) {
      Device d = Device::cuda(-1);
      d.uuid = std::string(num);
      return d;
    }
  }
  return invalid_argument("bad device '" + std::string(text) + "': expected cpu, cuda or cuda:N, or cuda:GPU-<uuid>");
}

std::optional<uint64_t> checked_mul(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}
std::optional<uint64_t> checked_add(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

StatusOr<uint64_t> TensorSpec::numel() const {
  uint64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0)
      return invalid_argument("tensor '" + name + "': dimension " + std::to_string(i) +
                              " is negative (" + std::to_string(shape[i]) + ")");
    auto r = checked_mul(n, static_cast<uint64_t>(shape[i]));
    if (!r) return invalid_argument("tensor '" + name + "': element count of shape " +
                                    shape_string() + " overflows 64 bits");
    n = *r;
  }
  return n;
}

StatusOr<uint64_t> TensorSpec::nbytes() const {
  auto n = numel();
  if (!n.ok()) return n.status();
  auto r = checked_mul(*n, dtype_size(dtype));
  if (!r) return invalid_argument("tensor '" + name + "': byte size of shape " + shape_string() +
                                  " x " + std::string(dtype_name(dtype)) + " overflows 64 bits");
  return *r;
}

std::string TensorSpec::shape_string() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string TensorSpec::type_string() const {
  std::string s(dtype_name(dtype));
  s += "[";
  for (size_t d = 0; d < shape.size(); ++d) {
    if (d) s += ",";
    s += std::to_string(shape[d]);
  }
  s += "]";
  return s;
}

}  // namespace paramcast
