// paramcast-worker: stands in for an inference engine. Registers buffers for
// the synthetic LLM (or takes tensors through a callback), receives updates,
// and verifies every byte of every version against the generator.
#include <atomic>
#include <csignal>
#include <cstring>
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
             "  --tp K --tp-rank T    serve only slice T of K of each weight (tensor parallelism,\n"
             "                        as vLLM cuts a LLaMA); sharded updates deliver them\n"
             "  -h, --help            print this and exit\n",
    .value_flags = {"config", "id", "endpoint", "mode", "updates", "model-size", "tp", "tp-rank"},
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

  // Tensor parallelism: this engine registers only its slices (sharded
  // updates deliver them) and checks each row of them against the generator.
  Status attach_slices(Subscriber& s, int tp, int rank) {
    for (const auto& spec : specs_) {
      const TpSlice cut = synthetic_tp_slice(spec, tp, rank);
      ShardView v;
      v.local.spec = spec;
      v.full_shape = spec.shape;
      v.offsets.assign(spec.shape.size(), 0);
      if (cut.dim >= 0) {
        v.local.spec.shape[static_cast<size_t>(cut.dim)] = cut.length;
        v.offsets[static_cast<size_t>(cut.dim)] = cut.start;
      }
      const uint64_t n = v.local.spec.nbytes().value();
      if (device_.is_cuda() && n) {  // in the device's memory
        auto p = mem_->allocate(n);
        if (!p.ok()) return p.status();
        buffers_.emplace_back(mem_.get(), *p, n);
        v.local.data = *p;
      } else {
        slices_.emplace_back(n);
        v.local.data = slices_.back().data();
      }
      v.local.device = device_;
      PC_RETURN_IF_ERROR(s.register_slice(v));
      views_.push_back(v);
    }
    s.on_update_end([this](uint64_t version, const Status& st) {
      if (!st.ok()) return;
      for (size_t i = 0; i < views_.size(); ++i) check_slice(specs_[i], views_[i], version);
    });
    return Status();
  }

  Status attach(Subscriber& s, const std::string& mode) {
    if (mode == "callback") {
      s.on_update_begin([this](uint64_t v) { in_progress_ = v; });
      s.on_tensor([this](const TensorView& view) {
        check(view.spec, view.data, in_progress_.load());
        return Status();
      });
      return Status();
    }
    PC_RETURN_IF_ERROR(mode == "arena" ? allocate_arena() : allocate_apart());
    for (size_t i = 0; i < specs_.size(); ++i)
      PC_RETURN_IF_ERROR(s.register_tensor(TensorView{specs_[i], at_[i], device_}));
    s.on_update_end([this](uint64_t version, const Status& st) {
      if (!st.ok()) return;
      for (size_t i = 0; i < specs_.size(); ++i) check(specs_[i], at_[i], version);
    });
    return Status();
  }

  // Each tensor a buffer of its own, as an engine's parameters are: carved
  // out of one block (a staging block each, 4 KiB-aligned and rounded up,
  // cost about 8 KiB a tensor: 410 MB for a 33 MiB model of 50,007 tensors),
  // each aligned and a gap apart, so that no two lie back to back and a
  // packed bucket never lands in place (that is the arena's case).
  Status allocate_apart() {
    uint64_t total = 0;
    std::vector<uint64_t> offset;
    for (const auto& spec : specs_) {
      offset.push_back(total);
      total += (spec.nbytes().value() + kPackAlignment - 1) / kPackAlignment * kPackAlignment + kPackAlignment;
    }
    auto p = mem_->allocate(std::max<uint64_t>(total, 1));
    if (!p.ok()) return p.status();
    buffers_.emplace_back(mem_.get(), *p, total);
    for (uint64_t o : offset) at_.push_back(static_cast<uint8_t*>(*p) + o);
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

  // A slice (rows of the box, each a run of its columns) against the
  // generator's bytes at the same places of the full tensor.
  void check_slice(const TensorSpec& full, const ShardView& v, uint64_t version) {
    const size_t elem = dtype_size(full.dtype);
    const int64_t cols = full.shape.size() == 2 ? full.shape[1] : 1;
    const int64_t rows = full.shape.size() == 2 ? v.local.spec.shape[0] : 1;
    const int64_t c0 = full.shape.size() == 2 ? v.offsets[1] : 0, r0 = full.shape.empty() ? 0 : v.offsets[0];
    const uint64_t run = static_cast<uint64_t>(full.shape.size() == 2 ? v.local.spec.shape[1] : v.local.spec.shape.empty() ? 1 : v.local.spec.shape[0]) * elem;
    std::vector<uint8_t> want(run), on_host;
    const uint8_t* got = static_cast<const uint8_t*>(v.local.data);
    if (device_.is_cuda() && got) {
      on_host.resize(static_cast<size_t>(v.local.spec.nbytes().value()));
      std::lock_guard<std::mutex> lock(mu_);  // mem_ is shared with check()
      if (Status s = mem_->copy(on_host.data(), got, on_host.size()); !s.ok()) {
        bad_.push_back(full.name + " slice could not be read back: " + s.message());
        return;
      }
      got = on_host.data();
    }
    for (int64_t r = 0; r < rows; ++r) {
      const uint64_t at = (static_cast<uint64_t>(r0 + r) * static_cast<uint64_t>(cols) + static_cast<uint64_t>(c0)) * elem;
      fill_synthetic_range(full, job_.seed, version, want.data(), at, run, job_.changes);
      if (memcmp(want.data(), got + static_cast<uint64_t>(r) * run, run) != 0) {
        std::lock_guard<std::mutex> lock(mu_);
        bad_.push_back(full.name + " slice differs in row " + std::to_string(r0 + r));
        return;
      }
    }
  }

  std::vector<std::vector<uint8_t>> slices_;  // attach_slices: this engine's slices
  std::vector<ShardView> views_;
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
  const int tp = std::atoi(flags.get("tp", "1").c_str()), tp_rank = std::atoi(flags.get("tp-rank", "0").c_str());
  if (tp < 1 || tp_rank < 0 || tp_rank >= tp) return usage_error(kTool, "--tp-rank must be in 0..--tp - 1");
  Status attached = tp > 1 ? verifier.attach_slices(s, tp, tp_rank) : verifier.attach(s, mode);
  if (!attached.ok()) return fail(id, attached);
  if (Status started = s.start(); !started.ok()) return fail(id, started);
  const int code = follow_reports(id, s, verifier, updates);
  s.stop();
  return code;
}
