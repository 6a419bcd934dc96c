// paramcast-trainer: publishes a synthetic LLM (see common/synthetic_model.h)
// N times, as a trainer would after every optimizer step, and reports each
// update's throughput. Wiring only: Publisher does the work.
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <thread>

#include "common/cli.h"
#include "common/data/device_memory.h"
#include "common/synthetic_model.h"
#include "common/units.h"
#include "trainer_side/publisher.h"

using namespace paramcast;

namespace {

const Tool kTool{
    .name = "paramcast-trainer",
    .usage = "usage: paramcast-trainer --config FILE.yaml [--endpoint tcp://H:P] [--endpoint-file F]\n"
             "                         [--updates N] [--model-size 64MiB]\n"
             "\n"
             "Publishes a synthetic LLM N times, as a trainer would after every optimizer\n"
             "step, and prints each update's throughput and every membership event.\n"
             "\n"
             "  --config FILE.yaml    the deployment (required)\n"
             "  --endpoint tcp://H:P  control endpoint to bind, instead of the file's\n"
             "  --endpoint-file F     write the bound endpoint (real port) to F\n"
             "  --updates N           number of updates, instead of the file's trainer.updates\n"
             "  --model-size SIZE     model size, instead of the file's trainer.model_size\n"
             "  --rank R              trainer rank R of a many-sender job (publisher.ranks > 1):\n"
             "                        each rank holds and sends only its rows of every tensor;\n"
             "                        rank 0 (the default) runs the publisher, R > 0 joins it at\n"
             "                        --endpoint; update u is version u on every rank\n"
             "  -h, --help            print this and exit\n",
    .value_flags = {"config", "endpoint", "endpoint-file", "updates", "model-size", "rank"},
};

// stdout is shared by the update loop and the event printer: each line is
// written whole, under this lock, and flushed at once (the output is often a
// pipe, read by `paramcast launch` or a test).
std::mutex g_out_mu;

__attribute__((format(printf, 1, 2))) void print_line(const char* fmt, ...) {
  std::lock_guard<std::mutex> lock(g_out_mu);
  va_list args;
  va_start(args, fmt);
  std::vprintf(fmt, args);
  va_end(args);
  std::fflush(stdout);
}

// One line per update with what each member received and the rate of its
// inbound link (as its parent measured it: "link"; its receive rate where
// the backend shows no links: "received at"), the slowest marked: where a
// slow update is slow.
void print_members(const UpdateResult& r) {
  std::string line;
  for (const auto& o : r.subscribers) {
    if (o.bytes == 0 && o.seconds == 0 && !o.shed) continue;
    line += (line.empty() ? "" : ", ") + o.worker_id + " " + format_bytes(o.bytes) +
            (o.link_rate > 0 ? ", link " + format_rate(o.link_rate) : ", received at " + format_rate(o.rate())) +
            (o.worker_id == r.slowest ? " (slowest)" : "") + (o.shed ? " (shed)" : "");
  }
  if (!line.empty())
    print_line("update v%llu members: %s\n", static_cast<unsigned long long>(r.version), line.c_str());
}

// How an update travelled: " as a delta", " dense (why)" with delta on.
std::string delta_text(const UpdateResult& r) {
  return r.delta ? " as a delta" : !r.dense_because.empty() ? " dense (" + r.dense_because + ")" : "";
}

// What crossed the data plane, labelled per engine and in total: "; on the
// wire: worker-1 7.90 MiB, worker-2 7.89 MiB, 15.79 MiB in total". A
// broadcast carries one copy of the (encoded) buckets to each subscriber;
// a many-sender update each engine's own pieces, as each reported them
// (trainer ranks receive nothing and are not listed). A broadcast with
// delta off says nothing: its wire is its size.
std::string wire_text(const UpdateResult& r, int ranks, bool sharded) {
  if (!sharded && delta_text(r).empty()) return "";
  std::vector<std::pair<std::string, uint64_t>> engines;
  for (const auto& o : r.subscribers) {
    bool trainer_rank = false;
    for (int k = 1; k < ranks; ++k) trainer_rank |= o.worker_id == trainer_rank_id(k);
    if (!trainer_rank && !o.shed) engines.emplace_back(o.worker_id, sharded ? o.bytes : r.wire_bytes);
  }
  uint64_t total = 0;
  for (const auto& e : engines) total += e.second;
  if (!sharded)
    return "; on the wire: " + format_bytes(r.wire_bytes) + " to each of " + std::to_string(engines.size()) +
           " subscribers, " + format_bytes(total) + " in total";
  constexpr size_t kListed = 8;
  std::string out = "; on the wire:";
  for (size_t i = 0; i < engines.size() && i < kListed; ++i)
    out += " " + engines[i].first + " " + format_bytes(engines[i].second) + ",";
  if (engines.size() > kListed) out += " " + std::to_string(engines.size() - kListed) + " more engines,";
  return out + " " + format_bytes(total) + " in total";
}

// The plan's control bytes, for a many-sender update: "; plan: 9.80 MiB
// whole to 2, 576 B by reference to 3 (kept: nothing planned); trainer
// ranks' parts by reference: 3" (Plan.shapeRef, Holdings.shapeRef,
// docs/protocol.md).
std::string plan_text(const UpdateResult& r) {
  const size_t whole = r.subscribers.size() - std::min(r.subscribers.size(), r.plan_referred);
  std::string out = "; plan:";
  if (r.plan_whole_bytes) out += " " + format_bytes(r.plan_whole_bytes) + " whole to " + std::to_string(whole);
  if (r.plan_whole_bytes && r.plan_referred) out += ",";
  if (r.plan_referred)
    out += " " + format_bytes(r.plan_referred_bytes) + " by reference to " + std::to_string(r.plan_referred);
  if (r.plan_kept) out += " (kept: nothing planned)";
  if (r.parts_referred) out += "; trainer ranks' parts by reference: " + std::to_string(r.parts_referred);
  if (r.holdings_bytes) out += "; trainer ranks' parts: " + format_bytes(r.holdings_bytes);
  return out;
}

// Prints membership events (joined, lost, rejoined, left) as they happen: a
// thread polls the publisher every 20 ms, so that a worker lost during a long
// update is reported then, not after the update returns.
class EventPrinter {
 public:
  explicit EventPrinter(Publisher& publisher) : publisher_(publisher), thread_([this] { run(); }) {}
  ~EventPrinter() { stop(); }
  EventPrinter(const EventPrinter&) = delete;
  EventPrinter& operator=(const EventPrinter&) = delete;

  // Stops the thread and prints the events it had not printed yet. Idempotent.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
    drain();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      lock.unlock();
      drain();
      lock.lock();
      cv_.wait_for(lock, std::chrono::milliseconds(20), [this] { return stopping_; });
    }
  }

  void drain() {
    while (auto e = publisher_.poll_event())
      print_line("member %s: %s (%s)\n", e->worker_id.c_str(), member_event_name(e->kind), e->detail.c_str());
  }

  Publisher& publisher_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

// The synthetic model in the publisher's device memory, rewritten before each
// update ("the optimizer step").
class SyntheticModel {
 public:
  static StatusOr<std::unique_ptr<SyntheticModel>> create(const Config& config) {
    auto mem = create_device_memory(config.publisher.device);
    if (!mem.ok()) return mem.status();
    std::unique_ptr<SyntheticModel> m(new SyntheticModel(config, std::move(mem.value())));
    for (const auto& s : m->specs_) {
      const uint64_t n = s.nbytes().value();
      auto p = m->mem_->allocate(n);
      if (!p.ok()) return p.status();
      m->buffers_.emplace_back(m->mem_.get(), *p, n);
      m->views_.push_back(TensorView{s, *p, config.publisher.device});
      m->total_ += n;
      m->largest_ = std::max(m->largest_, n);
    }
    return m;
  }

  void step(uint64_t version) {
    std::vector<uint8_t> host(largest_);
    for (size_t i = 0; i < specs_.size(); ++i) {
      const uint64_t n = specs_[i].nbytes().value();
      fill_synthetic(specs_[i], job_.seed, version, host.data(), n, job_.changes);
      (void)mem_->copy(buffers_[i].data(), host.data(), n);
    }
  }
  const std::vector<TensorView>& views() const { return views_; }
  size_t tensors() const { return specs_.size(); }
  uint64_t total() const { return total_; }

 private:
  SyntheticModel(const Config& config, std::unique_ptr<DeviceMemory> mem)
      : job_(config.trainer),
        specs_(synthetic_llm_layout(job_.model_bytes, job_.layers, job_.dtype)),
        mem_(std::move(mem)) {}

  const TrainerJobOptions job_;
  const std::vector<TensorSpec> specs_;
  std::unique_ptr<DeviceMemory> mem_;
  std::vector<StagingBuffer> buffers_;  // after mem_: released before it
  std::vector<TensorView> views_;
  uint64_t total_ = 0, largest_ = 0;
};

// One trainer rank's rows of the synthetic model (a many-sender job): host
// buffers of its rows only, refilled from the generator's byte ranges, so no
// rank ever holds a row it does not send. On a GPU (publisher.device) the
// rows it sends are in the device's memory, copied from the host rows at
// each step.
class ShardedModel {
 public:
  ShardedModel(const Config& config, int rank)
      : job_(config.trainer), specs_(synthetic_llm_layout(job_.model_bytes, job_.layers, job_.dtype)) {
    if (config.publisher.device.is_cuda()) {
      auto mem = create_device_memory(config.publisher.device);
      if (!mem.ok()) {
        status_ = mem.status();
        return;
      }
      mem_ = std::move(mem.value());
    }
    for (const auto& s : specs_) {
      const int64_t rows = s.shape.empty() ? 1 : s.shape[0];
      auto [first, count] = synthetic_shard_rows(rows, rank, config.publisher.ranks);
      if (s.shape.empty() && rank != 0) count = 0;
      const uint64_t row_bytes = s.nbytes().value() / static_cast<uint64_t>(std::max<int64_t>(rows, 1));
      ShardView v;
      v.local.spec = s;
      if (!s.shape.empty()) v.local.spec.shape[0] = count;
      v.full_shape = s.shape;
      v.offsets.assign(s.shape.size(), 0);
      if (!s.shape.empty()) v.offsets[0] = first;
      offset_.push_back(row_bytes * static_cast<uint64_t>(first));
      bytes_.emplace_back(row_bytes * static_cast<uint64_t>(count));
      v.local.data = bytes_.back().data();
      if (mem_ && !bytes_.back().empty()) {
        auto p = mem_->allocate(bytes_.back().size());
        if (!p.ok()) {
          status_ = p.status();
          return;
        }
        device_rows_.emplace_back(mem_.get(), *p, bytes_.back().size());
        v.local.data = *p;
        v.local.device = config.publisher.device;
      } else if (mem_) {
        v.local.data = nullptr;
        v.local.device = config.publisher.device;
      }
      total_ += bytes_.back().size();
      shards_.push_back(std::move(v));
    }
  }
  Status status() const { return status_; }
  Status step(uint64_t version) {
    for (size_t i = 0; i < specs_.size(); ++i) {
      fill_synthetic_range(specs_[i], job_.seed, version, bytes_[i].data(), offset_[i], bytes_[i].size(), job_.changes);
      if (mem_ && !bytes_[i].empty()) PC_RETURN_IF_ERROR(mem_->copy(shards_[i].local.data, bytes_[i].data(), bytes_[i].size()));
    }
    return mem_ ? mem_->synchronize() : Status();
  }
  const std::vector<ShardView>& shards() const { return shards_; }
  uint64_t total() const { return total_; }

 private:
  const TrainerJobOptions job_;
  const std::vector<TensorSpec> specs_;
  Status status_;
  std::unique_ptr<DeviceMemory> mem_;
  std::vector<StagingBuffer> device_rows_;  // after mem_: released before it
  std::vector<std::vector<uint8_t>> bytes_;
  std::vector<uint64_t> offset_;
  std::vector<ShardView> shards_;
  uint64_t total_ = 0;
};

// The process's resident set now and at its peak (/proc/self/status), in bytes.
std::pair<uint64_t, uint64_t> resident_memory() {
  std::ifstream in("/proc/self/status");
  std::string line;
  uint64_t now = 0, peak = 0;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) now = std::stoull(line.substr(6)) * 1024;
    if (line.rfind("VmHWM:", 0) == 0) peak = std::stoull(line.substr(6)) * 1024;
  }
  return {now, peak};
}

// Progress of long updates, for people watching a terminal (directly, or
// through `paramcast launch`, which sets PARAMCAST_PROGRESS=1 on a TTY).
void print_progress_when_watched(Publisher& publisher) {
  if (!isatty(1) && std::getenv("PARAMCAST_PROGRESS") == nullptr) return;
  auto last = std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::steady_clock::now());
  publisher.on_progress([last](uint64_t version, uint64_t sent, uint64_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (now - *last < std::chrono::seconds(1) || sent == total) return;
    *last = now;
    print_line("update v%llu: %3.0f%% (%s of %s)\n", static_cast<unsigned long long>(version),
               100.0 * static_cast<double>(sent) / static_cast<double>(total), format_bytes(sent).c_str(),
               format_bytes(total).c_str());
  });
}

struct Totals {
  int failures = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  double data_seconds = 0, apply_seconds = 0;  // UpdateResult's split of `seconds`
  void add(const UpdateResult& r) {
    bytes += r.bytes;
    seconds += r.seconds;
    data_seconds += r.data_seconds;
    apply_seconds += r.apply_seconds;
  }
};

std::string seconds_text(double s) {
  return format_duration(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(s)));
}

// Where an update's time went: the data plane (the rate ParamCast moved the
// bytes at), and the wait for the last Applied after it (the engines'
// checks of every byte and their on_update_end).
std::string split_text(const UpdateResult& r) {
  if (r.data_seconds <= 0) return "";
  std::string out = "; data plane " + seconds_text(r.data_seconds);
  out += " (" + format_rate(r.data_gbps() * 1e9) + ", the data plane alone)";
  if (r.apply_seconds > 0) {
    out += ", then ";
    out += seconds_text(r.apply_seconds);
    out += " to the last Applied (";
    out += r.last_to_apply;
    out += ": its checks and on_update_end)";
  }
  return out;
}

// The training loop: a step, then an update, `job.updates` times.
Totals run_updates(Publisher& publisher, SyntheticModel& model, const TrainerJobOptions& job) {
  Totals t;
  for (int u = 1; u <= job.updates; ++u) {
    const uint64_t version = publisher.next_version();  // above what any subscriber holds
    model.step(version);
    UpdateResult r = publisher.weight_update(model.views(), version);
    if (r.ok()) {
      t.add(r);
      std::string shed = wire_text(r, 1, false) + split_text(r);  // the shed list ends the line
      for (size_t i = 0; i < r.shed.size(); ++i) shed += (i ? ", " : "; shed: ") + r.shed[i];
      print_line("update v%llu: %zu tensors in %zu buckets, %s%s to %zu subscribers in %s (%s including the engines' "
                 "apply)%s\n",
                 static_cast<unsigned long long>(r.version), r.tensors, r.buckets, format_bytes(r.bytes).c_str(),
                 delta_text(r).c_str(), r.subscribers.size() - r.shed.size(),
                 format_duration(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::duration<double>(r.seconds)))
                     .c_str(),
                 format_rate(r.gbps() * 1e9).c_str(), shed.c_str());
    } else {
      ++t.failures;
      print_line("%s FAILED: %s\n", update_label(r.version).c_str(), r.status.to_string().c_str());
    }
    print_members(r);
    if (u < job.updates) std::this_thread::sleep_for(job.interval);
  }
  return t;
}

int fail(const Status& s) {
  std::fprintf(stderr, "paramcast-trainer: %s\n", s.to_string().c_str());
  return 1;
}

// Rank 0 of a many-sender job: its rows, then the publisher's plan for all.
Totals run_sharded_updates(Publisher& publisher, ShardedModel& model, const Config& config) {
  Totals t;
  for (int u = 1; u <= config.trainer.updates; ++u) {
    if (Status s = model.step(static_cast<uint64_t>(u)); !s.ok()) {
      ++t.failures;
      print_line("update v%d FAILED: %s\n", u, s.to_string().c_str());
      continue;
    }
    UpdateOptions options;
    options.version = static_cast<uint64_t>(u);
    UpdateResult r = publisher.weight_update_sharded(model.shards(), options);
    if (r.ok()) {
      t.add(r);
      const std::string wire = wire_text(r, config.publisher.ranks, true) + plan_text(r) + split_text(r);
      print_line("update v%llu: %zu tensors, %s%s from %d trainer ranks to %zu members in %s (%s including the "
                 "engines' apply)%s\n",
                 static_cast<unsigned long long>(r.version), r.tensors, format_bytes(r.bytes).c_str(),
                 delta_text(r).c_str(), config.publisher.ranks, r.subscribers.size(),
                 format_duration(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::duration<double>(r.seconds)))
                     .c_str(),
                 format_rate(r.gbps() * 1e9).c_str(), wire.c_str());
    } else {
      ++t.failures;
      print_line("%s FAILED: %s\n", update_label(r.version).c_str(), r.status.to_string().c_str());
    }
    if (u < config.trainer.updates) std::this_thread::sleep_for(config.trainer.interval);
  }
  return t;
}

// Trainer rank R > 0 of a many-sender job: joins rank 0 and sends its rows.
int run_rank(const Config& config, int rank) {
  auto r = PublisherRank::create(config, rank);
  if (!r.ok()) return fail(r.status());
  PublisherRank& me = *r.value();
  ShardedModel model(config, rank);
  if (Status s = model.status(); !s.ok()) return fail(s);
  if (Status s = model.step(1); !s.ok()) return fail(s);  // its rows are resident from here on
  const uint64_t resident = resident_memory().first;
  print_line("paramcast-trainer: trainer rank %d of %d (%s), %s of the model\n", rank, config.publisher.ranks,
             me.id().c_str(), format_bytes(model.total()).c_str());
  if (Status s = me.start(); !s.ok()) return fail(s);
  int failures = 0;
  for (int u = 1; u <= config.trainer.updates; ++u) {
    if (Status s = model.step(static_cast<uint64_t>(u)); !s.ok()) return fail(s);
    UpdateResult res = me.weight_update(model.shards(), static_cast<uint64_t>(u));  // rank 0 publishes version u
    if (res.ok()) {
      print_line("%s: v%llu sent\n", me.id().c_str(), static_cast<unsigned long long>(res.version));
    } else {
      ++failures;
      print_line("%s: update %d FAILED: %s\n", me.id().c_str(), u, res.status.to_string().c_str());
    }
  }
  const uint64_t baseline = me.baseline_bytes();
  me.stop();
  // What the updates cost this rank beyond its rows (resident after they
  // were filled, peak since): its sends leave from the rows themselves;
  // with deltas on, it keeps the pieces it sent (at most its rows).
  const uint64_t peak = resident_memory().second, growth = peak > resident ? peak - resident : 0;
  print_line("%s: resident %s with its rows, peak %s (+%s during updates; growth_bytes=%llu; delta baseline %s, "
             "baseline_bytes=%llu)\n",
             me.id().c_str(), format_bytes(resident).c_str(), format_bytes(peak).c_str(), format_bytes(growth).c_str(),
             static_cast<unsigned long long>(growth), format_bytes(baseline).c_str(),
             static_cast<unsigned long long>(baseline));
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags = parse_flags(argc, argv, 1, kTool);
  if (auto code = finish_flags(flags, kTool)) return *code;
  if (!flags.has("config")) return usage_error(kTool, "--config is required");
  auto loaded = load_tool_config(flags, "paramcast-trainer");
  if (!loaded) return 2;
  Config config = *loaded;
  if (flags.has("updates")) config.trainer.updates = std::max(1, std::atoi(flags.get("updates").c_str()));
  set_log_level(config.log_level);
  set_log_format(config.log_format);
  const int rank = std::atoi(flags.get("rank", "0").c_str());
  if (rank < 0 || rank >= config.publisher.ranks)
    return usage_error(kTool, "--rank " + flags.get("rank") + " is not among 0.." +
                                  std::to_string(config.publisher.ranks - 1) + " (publisher.ranks)");
  if (rank > 0) {
    if (!flags.has("endpoint")) return usage_error(kTool, "--rank R > 0 needs --endpoint (rank 0's control endpoint)");
    return run_rank(config, rank);
  }

  auto pub = Publisher::create(config);
  if (!pub.ok()) return fail(pub.status());
  Publisher& publisher = *pub.value();
  if (flags.has("endpoint-file")) {
    const std::string tmp = flags.get("endpoint-file") + ".tmp";
    std::ofstream(tmp) << publisher.endpoint() << "\n";
    std::rename(tmp.c_str(), flags.get("endpoint-file").c_str());
  }
  print_line("paramcast-trainer: control endpoint %s\n", publisher.endpoint().c_str());
  EventPrinter events(publisher);  // from here on, events are printed as they happen

  if (config.publisher.ranks > 1) {
    ShardedModel shard(config, 0);
    if (Status s = shard.status(); !s.ok()) return fail(s);
    print_line("paramcast-trainer: trainer rank 0 of %d, %s of the model\n", config.publisher.ranks,
               format_bytes(shard.total()).c_str());
    if (Status started = publisher.start(); !started.ok()) return fail(started);
    const Totals t = run_sharded_updates(publisher, shard, config);
    events.stop();
    print_line("paramcast-trainer: %d updates, %d failed\n", config.trainer.updates, t.failures);
    publisher.shutdown();
    return t.failures ? 1 : 0;
  }
  auto model = SyntheticModel::create(config);
  if (!model.ok()) return fail(model.status());
  print_line("paramcast-trainer: model of %zu tensors, %s (%s each update)\n", model.value()->tensors(),
             format_bytes(model.value()->total()).c_str(), dtype_name(config.trainer.dtype).data());
  if (Status started = publisher.start(); !started.ok()) return fail(started);
  print_progress_when_watched(publisher);
  const Totals t = run_updates(publisher, *model.value(), config.trainer);
  events.stop();  // before the summary line, and before shutdown() makes members leave
  print_line("paramcast-trainer: %d updates, %d failed, %s in %.3f s (%s including the engines' apply); of that the "
             "data plane %.3f s (%s, the data plane alone: the rate ParamCast moved the bytes at), the engines' checks "
             "and on_update_end %.3f s after it\n",
             config.trainer.updates, t.failures, format_bytes(t.bytes).c_str(), t.seconds,
             format_rate(t.seconds > 0 ? static_cast<double>(t.bytes) / t.seconds : 0.0).c_str(), t.data_seconds,
             format_rate(t.data_seconds > 0 ? static_cast<double>(t.bytes) / t.data_seconds : 0.0).c_str(),
             t.apply_seconds);
  publisher.shutdown();
  return t.failures ? 1 : 0;
}
