// paramcast-trainer: publishes a synthetic LLM (see common/synthetic_model.h)
// N times, as a trainer would after every optimizer step, and reports each
// update's throughput. Wiring only: Publisher does the work.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <thread>

#include "common/cli.h"
#include "common/data/device_memory.h"
#include "common/synthetic_model.h"
#include "common/units.h"
#include "trainer_side/publisher.h"

using namespace paramcast;

int main(int argc, char** argv) {
  Flags flags = parse_flags(argc, argv, 1);
  if (!flags.error.empty() || !flags.has("config")) {
    std::fprintf(stderr,
                 "usage: paramcast-trainer --config FILE.yaml [--endpoint tcp://H:P] [--endpoint-file F]\n"
                 "                         [--updates N] [--model-size 64MiB]\n%s\n",
                 flags.error.c_str());
    return 2;
  }
  auto loaded = load_tool_config(flags, "paramcast-trainer");
  if (!loaded) return 2;
  Config config = *loaded;
  if (flags.has("updates")) config.trainer.updates = std::max(1, std::atoi(flags.get("updates").c_str()));
  set_log_level(config.log_level);

  auto pub = Publisher::create(config);
  if (!pub.ok()) {
    std::fprintf(stderr, "paramcast-trainer: %s\n", pub.status().to_string().c_str());
    return 1;
  }
  Publisher& publisher = *pub.value();
  if (flags.has("endpoint-file")) {
    const std::string tmp = flags.get("endpoint-file") + ".tmp";
    std::ofstream(tmp) << publisher.endpoint() << "\n";
    std::rename(tmp.c_str(), flags.get("endpoint-file").c_str());
  }
  std::printf("paramcast-trainer: control endpoint %s\n", publisher.endpoint().c_str());
  std::fflush(stdout);

  const auto& job = config.trainer;
  auto specs = synthetic_llm_layout(job.model_bytes, job.layers, job.dtype);
  auto mem = create_device_memory(config.publisher.device);
  if (!mem.ok()) {
    std::fprintf(stderr, "paramcast-trainer: %s\n", mem.status().to_string().c_str());
    return 1;
  }
  std::vector<StagingBuffer> buffers;
  std::vector<TensorView> views;
  uint64_t total = 0, largest = 0;
  for (const auto& s : specs) {
    const uint64_t n = s.nbytes().value();
    auto p = mem.value()->allocate(n);
    if (!p.ok()) {
      std::fprintf(stderr, "paramcast-trainer: %s\n", p.status().to_string().c_str());
      return 1;
    }
    buffers.emplace_back(mem.value().get(), *p, n);
    views.push_back(TensorView{s, *p, config.publisher.device});
    total += n;
    largest = std::max(largest, n);
  }
  std::printf("paramcast-trainer: model of %zu tensors, %s (%s each update)\n", specs.size(),
              format_bytes(total).c_str(), dtype_name(job.dtype).data());

  Status started = publisher.start();
  if (!started.ok()) {
    std::fprintf(stderr, "paramcast-trainer: %s\n", started.to_string().c_str());
    return 1;
  }
  // Progress of long updates, for people watching a terminal (directly, or
  // through `paramcast launch`, which sets PARAMCAST_PROGRESS=1 on a TTY).
  const bool progress = isatty(1) || std::getenv("PARAMCAST_PROGRESS") != nullptr;
  if (progress) {
    auto last = std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::steady_clock::now());
    publisher.on_progress([last](uint64_t version, uint64_t sent, uint64_t total) {
      const auto now = std::chrono::steady_clock::now();
      if (now - *last < std::chrono::seconds(1) || sent == total) return;
      *last = now;
      std::printf("update v%llu: %3.0f%% (%s of %s)\n", static_cast<unsigned long long>(version),
                  100.0 * static_cast<double>(sent) / static_cast<double>(total), format_bytes(sent).c_str(),
                  format_bytes(total).c_str());
      std::fflush(stdout);
    });
  }
  std::vector<uint8_t> host(largest);
  int failures = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  for (int u = 1; u <= job.updates; ++u) {
    const uint64_t version = static_cast<uint64_t>(u);
    for (size_t i = 0; i < specs.size(); ++i) {  // "the optimizer step"
      const uint64_t n = specs[i].nbytes().value();
      fill_synthetic(specs[i], job.seed, version, host.data(), n);
      (void)mem.value()->copy(buffers[i].data(), host.data(), n);
    }
    UpdateResult r = publisher.weight_update(views, version);
    if (r.ok()) {
      bytes += r.bytes;
      seconds += r.seconds;
      std::printf("update v%llu: %zu tensors in %zu buckets, %s to %zu subscribers in %s (%.2f GB/s)\n",
                  static_cast<unsigned long long>(r.version), r.tensors, r.buckets, format_bytes(r.bytes).c_str(),
                  r.subscribers.size(), format_duration(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                            std::chrono::duration<double>(r.seconds)))
                                            .c_str(),
                  r.gbps());
    } else {
      ++failures;
      std::printf("update v%llu FAILED: %s\n", static_cast<unsigned long long>(r.version), r.status.to_string().c_str());
    }
    std::fflush(stdout);
    while (auto e = publisher.poll_event())
      std::printf("member %s: %s (%s)\n", e->worker_id.c_str(), member_event_name(e->kind), e->detail.c_str());
    if (u < job.updates) std::this_thread::sleep_for(job.interval);
  }
  std::printf("paramcast-trainer: %d updates, %d failed, %s in %.3f s (%.2f GB/s)\n", job.updates, failures,
              format_bytes(bytes).c_str(), seconds, seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0);
  publisher.shutdown();
  return failures ? 1 : 0;
}
