// paramcast-transform-bench: the CPU rate of transforms on send (GB/s of the
// trainer's bytes in), against a memcpy of the same bytes in the same run.
//
//   paramcast-transform-bench [--rows 8192] [--cols 8192] [--repeats 5]
//
// One BF16 matrix (rows x cols, values of a trained layer's scale), each of
// fp8 block / channel / tensor and cast fp32<-bf16, best of --repeats; one
// line per transform and a SUMMARY line.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/transform/transform.h"

using namespace paramcast;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  int64_t rows = 8192, cols = 8192;
  int repeats = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--rows") rows = std::stoll(argv[i + 1]);
    else if (k == "--cols") cols = std::stoll(argv[i + 1]);
    else if (k == "--repeats") repeats = std::stoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown flag %s (flags: --rows --cols --repeats)\n", k.c_str());
      return 2;
    }
  }
  const uint64_t n = static_cast<uint64_t>(rows * cols);
  std::vector<uint16_t> x(n);
  uint32_t s = 12345;
  for (auto& v : x) {  // a normal-ish spread of std ~0.02
    s = s * 1664525u + 1013904223u;
    const float u = (static_cast<float>(s >> 8) / 16777216.0f - 0.5f) * 0.07f;
    v = transform::bf16_from_float(u);
  }
  TensorView in{TensorSpec{"w", DType::kBF16, {rows, cols}}, x.data(), Device::cpu()};
  std::vector<uint8_t> out(n * 4);
  std::vector<float> scales(static_cast<size_t>(std::max<int64_t>(rows, 1) * ((cols + 127) / 128 + 1)));
  auto best = [&](auto&& fn) {
    double b = 1e30;
    for (int r = 0; r < repeats; ++r) {
      const auto t0 = Clock::now();
      fn();
      b = std::min(b, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return b;
  };
  const double bytes_in = static_cast<double>(n) * 2;
  const double copy = best([&] { std::memcpy(out.data(), x.data(), n * 2); });
  std::printf("memcpy            %8.3f GB/s\n", bytes_in / copy / 1e9);
  struct Case {
    const char* name;
    transform::Transform t;
  };
  const Case cases[] = {
      {"fp8 block", {transform::Transform::Kind::kFp8, DType::kF8E4M3, transform::Fp8Scaling::kBlock, 0}},
      {"fp8 channel", {transform::Transform::Kind::kFp8, DType::kF8E4M3, transform::Fp8Scaling::kChannel, 0}},
      {"fp8 tensor", {transform::Transform::Kind::kFp8, DType::kF8E4M3, transform::Fp8Scaling::kTensor, 0}},
      {"cast fp32", {transform::Transform::Kind::kCast, DType::kF32, transform::Fp8Scaling::kBlock, 0}},
  };
  std::string summary = "SUMMARY transform rows=" + std::to_string(rows) + " cols=" + std::to_string(cols);
  for (const auto& c : cases) {
    Status st;
    const double t = best([&] { st = transform::apply(in, c.t, out.data(), scales.data()); });
    if (!st.ok()) {
      std::fprintf(stderr, "%s: %s\n", c.name, st.to_string().c_str());
      return 1;
    }
    std::printf("%-17s %8.3f GB/s in  (%.3f x memcpy)\n", c.name, bytes_in / t / 1e9, copy / t);
    char part[96];
    std::snprintf(part, sizeof part, " %s=%.3fGB/s", c.name, bytes_in / t / 1e9);
    summary += part;
  }
  char part[64];
  std::snprintf(part, sizeof part, " memcpy=%.3fGB/s", bytes_in / copy / 1e9);
  std::printf("%s%s\n", summary.c_str(), part);
  return 0;
}
