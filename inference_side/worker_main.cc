// paramcast-worker: stands in for an inference engine. Registers buffers for
// the synthetic LLM (or takes tensors through a callback), receives updates,
// and verifies every byte of every version against the generator.
#include <atomic>
#include <csignal>
#include <cstdio>
#include <map>
#include <mutex>

#include "common/cli.h"
#include "common/data/device_memory.h"
#include "common/synthetic_model.h"
#include "common/units.h"
#include "inference_side/subscriber.h"

using namespace paramcast;

namespace {
std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop = true; }

const Tool kTool{
    .name = "paramcast-worker",
    .usage = "usage: paramcast-worker --config FILE.yaml --id WORKER_ID [--endpoint tcp://H:P]\n"
             "                        [--mode registered|callback] [--updates N (0: run until stopped)]\n"
             "                        [--model-size 64MiB]\n"
             "\n"
             "Stands in for an inference engine: joins the publisher, receives every update\n"
             "of the synthetic LLM and verifies every byte. Stops on SIGTERM / SIGINT.\n"
             "\n"
             "  --config FILE.yaml    the deployment (required)\n"
             "  --id WORKER_ID        this worker's id, e.g. worker-1 (required)\n"
             "  --endpoint tcp://H:P  the publisher's control endpoint, instead of the file's\n"
             "  --mode MODE           registered: tensors land in registered buffers (default);\n"
             "                        callback: each tensor is handed to a callback\n"
             "  --updates N           exit after N verified updates (0: run until stopped;\n"
             "                        default: the file's trainer.updates)\n"
             "  --model-size SIZE     model size, instead of the file's trainer.model_size\n"
             "  -h, --help            print this and exit\n",
    .value_flags = {"config", "id", "endpoint", "mode", "updates", "model-size"},
};
}  // namespace

int main(int argc, char** argv) {
  Flags flags = parse_flags(argc, argv, 1, kTool);
  if (auto code = finish_flags(flags, kTool)) return *code;
  if (!flags.has("config")) return usage_error(kTool, "--config is required");
  if (!flags.has("id")) return usage_error(kTool, "--id is required");
  auto loaded = load_tool_config(flags, "paramcast-worker");
  if (!loaded) return 2;
  Config config = *loaded;
  const std::string id = flags.get("id");
  const std::string mode = flags.get("mode", "registered");
  const int updates = flags.has("updates") ? std::atoi(flags.get("updates").c_str()) : config.trainer.updates;
  set_log_level(config.log_level);
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);

  auto sub = Subscriber::create(config, id);
  if (!sub.ok()) {
    std::fprintf(stderr, "paramcast-worker %s: %s\n", id.c_str(), sub.status().to_string().c_str());
    return 1;
  }
  Subscriber& s = *sub.value();
  const Device device = config.device_for_worker(id);
  const auto& job = config.trainer;
  auto specs = synthetic_llm_layout(job.model_bytes, job.layers, job.dtype);
  auto mem = create_device_memory(device);
  if (!mem.ok()) {
    std::fprintf(stderr, "paramcast-worker %s: %s\n", id.c_str(), mem.status().to_string().c_str());
    return 1;
  }
  std::vector<StagingBuffer> buffers;
  std::mutex bad_mu;
  std::vector<std::string> bad;  // mismatches of the version in progress
  std::vector<uint8_t> host;
  auto check = [&](const TensorSpec& spec, const void* data, uint64_t version) {
    const uint64_t n = spec.nbytes().value();
    const void* p = data;
    if (device.is_cuda()) {
      host.resize(n);
      (void)mem.value()->copy(host.data(), data, n);
      p = host.data();
    }
    int64_t at = verify_synthetic(spec, job.seed, version, p, n);
    if (at >= 0) {
      std::lock_guard<std::mutex> lock(bad_mu);
      bad.push_back(spec.name + " differs at byte " + std::to_string(at));
    }
  };
  if (mode == "callback") {
    static std::atomic<uint64_t> version_in_progress{0};
    std::atomic<uint64_t>* current = &version_in_progress;
    s.on_update_begin([current](uint64_t v) { current->store(v); });
    s.on_tensor([&, current](const TensorView& view) {
      check(view.spec, view.data, current->load());
      return Status();
    });
  } else {
    for (const auto& spec : specs) {
      const uint64_t n = spec.nbytes().value();
      auto p = mem.value()->allocate(n);
      if (!p.ok()) {
        std::fprintf(stderr, "paramcast-worker %s: %s\n", id.c_str(), p.status().to_string().c_str());
        return 1;
      }
      buffers.emplace_back(mem.value().get(), *p, n);
      Status r = s.register_tensor(TensorView{spec, *p, device});
      if (!r.ok()) {
        std::fprintf(stderr, "paramcast-worker %s: %s\n", id.c_str(), r.to_string().c_str());
        return 1;
      }
    }
    // Verify inside the end hook: the next update cannot start writing until it returns.
    s.on_update_end([&](uint64_t version, const Status& st) {
      if (!st.ok()) return;
      for (size_t i = 0; i < specs.size(); ++i) check(specs[i], buffers[i].data(), version);
    });
  }
  Status started = s.start();
  if (!started.ok()) {
    std::fprintf(stderr, "paramcast-worker %s: %s\n", id.c_str(), started.to_string().c_str());
    return 1;
  }
  int verified = 0, failed = 0;
  while (!g_stop && (updates == 0 || verified < updates)) {
    auto report = s.next_report(std::chrono::milliseconds(200));
    if (!report) continue;
    if (report->version == 0 && !report->status.ok()) {  // rejected by the publisher
      std::fprintf(stderr, "paramcast-worker %s: %s\n", id.c_str(), report->status.to_string().c_str());
      return 1;
    }
    if (!report->status.ok()) {
      ++failed;
      std::printf("%s: update v%llu failed: %s (state %s)\n", id.c_str(), static_cast<unsigned long long>(report->version),
                  report->status.to_string().c_str(), s.state().to_string().c_str());
      std::fflush(stdout);
      continue;
    }
    std::vector<std::string> mismatches;
    {
      std::lock_guard<std::mutex> lock(bad_mu);
      mismatches.swap(bad);
    }
    if (!mismatches.empty()) {
      std::printf("%s: v%llu CORRUPT: %zu tensors differ, first: %s\n", id.c_str(),
                  static_cast<unsigned long long>(report->version), mismatches.size(), mismatches[0].c_str());
      std::fflush(stdout);
      return 1;
    }
    ++verified;
    std::printf("%s: v%llu verified, %s bit-exact\n", id.c_str(), static_cast<unsigned long long>(report->version),
                format_bytes(report->bytes).c_str());
    std::fflush(stdout);
  }
  std::printf("%s: %d updates verified, %d failed; state %s\n", id.c_str(), verified, failed,
              s.state().to_string().c_str());
  s.stop();
  return (updates == 0 || verified >= updates) ? 0 : 1;
}
