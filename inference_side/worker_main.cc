// paramcast-worker: stands in for an inference engine. Registers buffers for
// the synthetic LLM (or takes tensors through a callback), receives updates,
// and verifies every byte of every version against the generator.
#include <atomic>
#include <csignal>
#include <cstdio>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "common/cli.h"
#include "common/data/device_memory.h"
#include "common/log.h"
#include "common/plan.h"
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
             "                        [--mode registered|arena|callback] [--updates N (0: run until stopped)]\n"
             "                        [--model-size 64MiB]\n"
             "\n"
             "Stands in for an inference engine: joins the publisher, receives every update\n"
             "of the synthetic LLM and verifies every byte. Stops on SIGTERM / SIGINT.\n"
             "\n"
             "  --config FILE.yaml    the deployment (required)\n"
             "  --id WORKER_ID        this worker's id, e.g. worker-1 (required)\n"
             "  --endpoint tcp://H:P  the publisher's control endpoint, instead of the file's\n"
             "  --mode MODE           registered: tensors land in registered buffers (default);\n"
             "                        arena: registered in one buffer, small tensors in bucket\n"
             "                        layout (packed buckets land in place, as in a weight arena);\n"
             "                        callback: each tensor is handed to a callback\n"
             "  --updates N           exit after N verified updates (0: run until stopped;\n"
             "                        default: the file's trainer.updates)\n"
             "  --model-size SIZE     model size, instead of the file's trainer.model_size\n"
             "  -h, --help            print this and exit\n",
    .value_flags = {"config", "id", "endpoint", "mode", "updates", "model-size"},
};
// Checks what arrives against the synthetic generator, in registered
// buffers (verified in the end hook: the next update cannot start writing
// until it returns) or tensor by tensor through the callback.
class Verifier {
 public:
  Verifier(const std::string& id, const Config& config, std::unique_ptr<DeviceMemory> mem)
      : id_(id),
        data_plane_(config.data_plane),
        job_(config.trainer),
        device_(config.device_for_worker(id)),
        specs_(synthetic_llm_layout(job_.model_bytes, job_.layers, job_.dtype)),
        mem_(std::move(mem)) {}

  Status attach(Subscriber& s, const std::string& mode) {
    if (mode == "callback") {
      s.on_update_begin([this](uint64_t v) { in_progress_ = v; });
      s.on_tensor([this](const TensorView& view) {
        check(view.spec, view.data, in_progress_.load());
        return Status();
      });
      return Status();
    }
    if (mode == "arena") {
      PC_RETURN_IF_ERROR(allocate_arena());
    } else {
      for (const auto& spec : specs_) {
        const uint64_t n = spec.nbytes().value();
        auto p = mem_->allocate(n);
        if (!p.ok()) return p.status();
        buffers_.emplace_back(mem_.get(), *p, n);
        at_.push_back(static_cast<uint8_t*>(*p));
      }
    }
    for (size_t i = 0; i < specs_.size(); ++i)
      PC_RETURN_IF_ERROR(s.register_tensor(TensorView{specs_[i], at_[i], device_}));
    s.on_update_end([this](uint64_t version, const Status& st) {
      if (!st.ok()) return;
      for (size_t i = 0; i < specs_.size(); ++i) check(specs_[i], at_[i], version);
    });
    return Status();
  }

  // One buffer for every tensor, the small ones where the publisher's plan
  // packs them (each packed bucket's tensors at their bucket offsets), the
  // large ones each in a region of its own: packed buckets land in place.
  Status allocate_arena() {
    auto plan = build_plan(1, specs_, data_plane_);
    if (!plan.ok()) return plan.status();
    auto aligned = [](uint64_t n) { return (n + kPackAlignment - 1) / kPackAlignment * kPackAlignment; };
    std::vector<uint64_t> offset(specs_.size(), 0);
    uint64_t total = 0;
    for (const auto& b : plan->buckets) {
      if (b.direct) {
        if (b.pieces[0].tensor_offset == 0) {
          offset[b.pieces[0].tensor] = total;
          total += aligned(plan->nbytes[b.pieces[0].tensor]);
        }
        continue;
      }
      for (const auto& p : b.pieces) offset[p.tensor] = total + p.bucket_offset;
      total += aligned(b.bytes);
    }
    auto p = mem_->allocate(std::max<uint64_t>(total, 1));
    if (!p.ok()) return p.status();
    buffers_.emplace_back(mem_.get(), *p, total);
    for (size_t i = 0; i < specs_.size(); ++i) at_.push_back(static_cast<uint8_t*>(*p) + offset[i]);
    return Status();
  }

  // The mismatches found in the update that just ended.
  std::vector<std::string> take_mismatches() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(bad_, {});
  }

 private:
  void check(const TensorSpec& spec, const void* data, uint64_t version) {
    const uint64_t n = spec.nbytes().value();
    std::lock_guard<std::mutex> lock(mu_);
    const void* p = data;
    if (device_.is_cuda()) {
      host_.resize(n);
      (void)mem_->copy(host_.data(), data, n);
      p = host_.data();
    }
    const int64_t at = verify_synthetic(spec, job_.seed, version, p, n, job_.changes);
    if (at >= 0) bad_.push_back(spec.name + " differs at byte " + std::to_string(at));
  }

  const std::string id_;
  const DataPlaneOptions data_plane_;
  const TrainerJobOptions job_;
  const Device device_;
  const std::vector<TensorSpec> specs_;
  std::unique_ptr<DeviceMemory> mem_;
  std::vector<StagingBuffer> buffers_;  // after mem_: released before it
  std::vector<uint8_t*> at_;            // where each registered tensor is
  std::atomic<uint64_t> in_progress_{0};
  std::mutex mu_;  // guards the two below
  std::vector<uint8_t> host_;
  std::vector<std::string> bad_;  // mismatches of the version in progress
};

int fail(const std::string& id, const Status& s) {
  std::fprintf(stderr, "paramcast-worker %s: %s\n", id.c_str(), s.to_string().c_str());
  return 1;
}

// Prints each update's outcome until `updates` verified (0: until stopped).
// Returns the exit code.
int follow_reports(const std::string& id, Subscriber& s, Verifier& verifier, int updates) {
  int verified = 0, failed = 0;
  while (!g_stop && (updates == 0 || verified < updates)) {
    auto report = s.next_report(std::chrono::milliseconds(200));
    if (!report) continue;
    if (report->version == 0 && !report->status.ok()) return fail(id, report->status);  // refused by the publisher
    if (!report->status.ok()) {
      ++failed;
      std::printf("%s: update v%llu failed: %s (state %s)\n", id.c_str(),
                  static_cast<unsigned long long>(report->version), report->status.to_string().c_str(),
                  s.state().to_string().c_str());
      std::fflush(stdout);
      continue;
    }
    const std::vector<std::string> mismatches = verifier.take_mismatches();
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
  return (updates == 0 || verified >= updates) ? 0 : 1;
}

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
  set_log_format(config.log_format);
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);

  auto sub = Subscriber::create(config, id);
  if (!sub.ok()) return fail(id, sub.status());
  Subscriber& s = *sub.value();
  auto mem = create_device_memory(config.device_for_worker(id));
  if (!mem.ok()) return fail(id, mem.status());
  Verifier verifier(id, config, std::move(mem.value()));
  if (Status attached = verifier.attach(s, mode); !attached.ok()) return fail(id, attached);
  if (Status started = s.start(); !started.ok()) return fail(id, started);
  const int code = follow_reports(id, s, verifier, updates);
  s.stop();
  return code;
}
