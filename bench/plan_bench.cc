// paramcast-plan-bench: the many-sender planner at frontier scale
// (DeepSeek-V3, Kimi-K2, Qwen3-235B; tests/support/frontier_shapes.h), one
// rank at a time, on one core: each measured rank runs in a child process
// of its own that builds the job's layout table (as it would decode it),
// checks it (rank 0), and plans its own part, so that its peak RSS is its
// own. Per configuration it prints:
//   - the layout table's wire size (the first update's one large control
//     message), its decode time, and the whole-job check on rank 0;
//   - per measured rank: planning wall time, peak RSS, moves, pair
//     batches (small pieces of a pair travelling together), bytes in/out;
//   - a cached update: the rank compares the digest the update names with
//     its cached plan's and reuses the plan (no planning);
//   - the busiest link over the measured ranks and its time at --rate;
//   - with --baseline, plan_reshard() (the explicit planner) on the same
//     job, in the same run, on the configurations small enough for it.
//
//   paramcast-plan-bench [--models all|deepseek|kimi|qwen] [--m 64,256]
//                        [--replicas 2,16] [--all-ranks] [--baseline]
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/reshard/layout_proto.h"
#include "common/reshard/rank_plan.h"
#include "tests/support/frontier_shapes.h"

namespace {

using namespace paramcast;
using namespace paramcast::reshard;
using paramcast::testing::FrontierJob;
using paramcast::testing::FrontierModel;
using paramcast::testing::TrainerLayout;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kBucketBytes = 4ull << 20;  // a pair's batch of small pieces
constexpr double kRate = 50e9;                  // bytes/s per GPU link (400 Gb/s NIC)

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Config {
  FrontierModel model;
  TrainerLayout trainer;
  int m, replicas;
};

// What one rank's child reports back.
struct RankFigures {
  double build_s = 0, decode_s = 0, check_s = 0, plan_s = 0, cached_ms = 0;
  long peak_kib = 0;
  uint64_t table_bytes = 0, moves = 0, batches = 0, bytes_in = 0, bytes_out = 0, tensors = 0;
};

RankFigures measure_rank(const Config& c, int rank) {
  RankFigures f;
  auto t = Clock::now();
  FrontierJob built(c.model, c.trainer, c.m, c.replicas);
  const std::vector<uint8_t> wire = layout_bytes(built.job());
  f.build_s = since(t);
  f.table_bytes = wire.size();
  built = FrontierJob(FrontierModel::kQwen3_235B, c.trainer, 1, 1);  // let the sender's copy go
  t = Clock::now();
  auto job = layout_from_bytes(wire);
  f.decode_s = since(t);
  if (!job.ok()) {
    std::fprintf(stderr, "decode: %s\n", job.status().message().c_str());
    _exit(2);
  }
  f.tensors = job->tensors.size();
  if (rank == 0) {
    t = Clock::now();
    Status s = check_layout(*job);
    f.check_s = since(t);
    if (!s.ok()) {
      std::fprintf(stderr, "check: %s\n", s.message().c_str());
      _exit(3);
    }
  }
  t = Clock::now();
  RankPlan plan = rank_plan(*job, rank);
  const auto sends = pair_batches(plan.sends, kBucketBytes), receives = pair_batches(plan.receives, kBucketBytes);
  f.plan_s = since(t);
  // A cached update names the digests of the tensor list and the layout:
  // the rank finds its plan under them and takes it as it is.
  PlanCache cache;
  const PlanKey key = plan_key(*job, wire, rank);
  const RankPlan& kept = cache.put(key, std::move(plan));
  t = Clock::now();
  const RankPlan* hit = cache.find(key, nullptr);
  f.cached_ms = since(t) * 1e3;
  if (hit != &kept) _exit(5);
  f.moves = kept.sends.size() + kept.receives.size();
  f.batches = sends.size() + receives.size();
  f.bytes_in = kept.bytes_in;
  f.bytes_out = kept.bytes_out;
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  f.peak_kib = ru.ru_maxrss;
  return f;
}

// Runs measure_rank in a child process; its peak RSS is its own.
RankFigures in_child(const Config& c, int rank) {
  int fds[2];
  if (pipe(fds) != 0) std::abort();
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    RankFigures f = measure_rank(c, rank);
    if (write(fds[1], &f, sizeof f) != static_cast<ssize_t>(sizeof f)) _exit(4);
    _exit(0);
  }
  close(fds[1]);
  RankFigures f;
  const ssize_t got = read(fds[0], &f, sizeof f);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (got != static_cast<ssize_t>(sizeof f) || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "rank %d failed (status %d)\n", rank, status);
    std::exit(1);
  }
  return f;
}

std::vector<int> measured_ranks(const Config& c, bool all) {
  const int world = c.m + c.replicas * FrontierJob::kTp;
  std::vector<int> out;
  if (all) {
    for (int r = 0; r < world; ++r) out.push_back(r);
    return out;
  }
  // Trainer ranks 0, the middle one and the last; every engine rank of the
  // first replica and of the last (a chain's first and last hops).
  out = {0, c.m / 2, c.m - 1};
  for (int t = 0; t < FrontierJob::kTp; ++t) out.push_back(c.m + t);
  if (c.replicas > 1)
    for (int t = 0; t < FrontierJob::kTp; ++t) out.push_back(c.m + (c.replicas - 1) * FrontierJob::kTp + t);
  return out;
}

void baseline(const Config& c) {
  FrontierJob built(c.model, c.trainer, c.m, c.replicas);
  auto manifests = expand(built.job());
  const auto t = Clock::now();
  auto plan = plan_reshard(manifests);
  std::printf("  baseline plan_reshard (the whole job, explicit regions): %.2f s, %zu transfers%s\n", since(t),
              plan.ok() ? plan->transfers.size() : 0, plan.ok() ? "" : " (refused)");
}

void run(const Config& c, bool all, bool with_baseline) {
  const char* layout = c.trainer == TrainerLayout::kFsdp ? "FSDP2 Shard(0)" : "experts on rank e mod M, rest Shard(0)";
  std::printf("%s, %s, M=%d -> %d x TP=8 (%d engine ranks)\n", model_name(c.model), layout, c.m, c.replicas,
              c.replicas * FrontierJob::kTp);
  double worst_plan = 0, worst_cached = 0;
  long worst_kib = 0;
  uint64_t busiest = 0, moves = 0, batches = 0;
  RankFigures first{};
  for (int r : measured_ranks(c, all)) {
    RankFigures f = in_child(c, r);
    if (r == 0) first = f;
    worst_plan = std::max(worst_plan, f.plan_s + (r == 0 ? f.check_s : 0));
    worst_cached = std::max(worst_cached, f.cached_ms);
    worst_kib = std::max(worst_kib, f.peak_kib);
    busiest = std::max({busiest, f.bytes_in, f.bytes_out});
    moves = std::max(moves, f.moves);
    batches = std::max(batches, f.batches);
    std::printf("  rank %3d: plan %.3f s, peak RSS %ld MiB, %lu moves in %lu batches, in %.2f GB, out %.2f GB\n", r,
                f.plan_s, f.peak_kib / 1024, static_cast<unsigned long>(f.moves), static_cast<unsigned long>(f.batches),
                static_cast<double>(f.bytes_in) / 1e9, static_cast<double>(f.bytes_out) / 1e9);
  }
  std::printf("  %lu tensors; layout table %.2f MiB (built in %.2f s, decoded in %.3f s); whole-job check on rank 0 "
              "%.3f s\n",
              static_cast<unsigned long>(first.tensors), static_cast<double>(first.table_bytes) / (1 << 20),
              first.build_s, first.decode_s, first.check_s);
  std::printf("SUMMARY %s %s M=%d R=%d: first update: worst rank plan %.3f s (rank 0 with the check), peak RSS %ld "
              "MiB; cached %.3f ms; table %.2f MiB; most moves %lu (%lu batches); busiest link %.1f GB = %.2f s at "
              "50 GB/s\n",
              model_name(c.model), c.trainer == TrainerLayout::kFsdp ? "fsdp" : "ep", c.m, c.replicas, worst_plan,
              worst_kib / 1024, worst_cached, static_cast<double>(first.table_bytes) / (1 << 20),
              static_cast<unsigned long>(moves), static_cast<unsigned long>(batches),
              static_cast<double>(busiest) / 1e9, static_cast<double>(busiest) / kRate);
  if (with_baseline) baseline(c);
  std::fflush(stdout);
}

std::vector<int> ints(const char* csv) {
  std::vector<int> out;
  for (const char* p = csv; *p;) {
    out.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p) ++p;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string models = "all";
  std::vector<int> ms = {64, 256}, replicas = {2, 16};
  bool all = false, with_baseline = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--models" && i + 1 < argc) models = argv[++i];
    else if (a == "--m" && i + 1 < argc) ms = ints(argv[++i]);
    else if (a == "--replicas" && i + 1 < argc) replicas = ints(argv[++i]);
    else if (a == "--all-ranks") all = true;
    else if (a == "--baseline") with_baseline = true;
    else {
      std::fprintf(stderr, "usage: %s [--models all|deepseek|kimi|qwen] [--m 64,256] [--replicas 2,16] [--all-ranks] "
                           "[--baseline]\n", argv[0]);
      return 2;
    }
  }
  std::vector<FrontierModel> list;
  if (models == "all" || models == "deepseek") list.push_back(FrontierModel::kDeepSeekV3);
  if (models == "all" || models == "kimi") list.push_back(FrontierModel::kKimiK2);
  if (models == "all" || models == "qwen") list.push_back(FrontierModel::kQwen3_235B);
  for (auto model : list)
    for (auto trainer : {TrainerLayout::kFsdp, TrainerLayout::kExpertParallel})
      for (int m : ms)
        for (int r : replicas) run({model, trainer, m, r}, all, with_baseline);
  return 0;
}
