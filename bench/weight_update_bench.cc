// paramcast-bench: weight_update against the raw backend broadcast of the
// same bytes, in one run, on one machine.
//
//   (a) raw:     one flat buffer of S bytes broadcast from rank 0 (Communicator
//                directly: no plan, no control plane, no staging); on Gloo
//                also (a0) gloo::broadcast, libgloo's own collective, of the
//                same buffer (bench/library_broadcast.h), so that ParamCast's
//                pipelined tree is measured against the library's;
//   (b) update:  Publisher::weight_update of S bytes split into T tensors;
//   (c) latency: a 4-byte update, round trip, p50/p99 (steady state, and with
//                the plan/accept round trip forced on every update);
//   (d) memory:  peak staging per side, and host RSS growth of the receivers;
//   (e) copies:  pack throughput (10,000 pieces) vs one memcpy of S bytes.
// The root is this process; the other ranks are this program re-executed with
// --role receiver. Phases are sequenced through a FileStore in a temp dir.
// Output: a human summary, and JSON with --json FILE.
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/cli.h"
#include "common/data/bucket_checksum.h"
#include "common/data/communicator.h"
#include "common/data/device_memory.h"
#include "common/data/file_store.h"
#include "common/plan.h"
#include "common/synthetic_model.h"
#include "common/units.h"
#include "bench/library_broadcast.h"
#include "inference_side/subscriber.h"
#include "tests/support/process.h"
#include "trainer_side/publisher.h"

using namespace paramcast;

namespace {

struct Options {
  Backend backend = Backend::kGloo;
  int world = 8;
  uint64_t size = 1ull << 30;
  std::vector<int> counts = {1, 291, 10000};
  int repeats = 3;
  int latency_updates = 200;
  uint64_t bucket = 256ull << 20;
  Checksum checksum = Checksum::kNone;
  std::string dir;
  std::string json;
  int gpus = 1;
  bool arena = false;
};

Device device_for(const Options& o, int rank) {
  if (o.backend != Backend::kNccl) return Device::cpu();
  return Device::cuda(rank % std::max(1, o.gpus));
}

std::vector<TensorSpec> layout(int count, uint64_t size) {
  if (count == 291) return synthetic_llm_layout(size, 32, DType::kBF16);
  std::vector<TensorSpec> out;
  // Whole multiples of 256 bytes, as weight shapes make them; the rest goes last.
  const uint64_t each = size / static_cast<uint64_t>(count) / 256 * 256;
  for (int i = 0; i < count; ++i) {
    const uint64_t n = i + 1 == count ? size - each * (count - 1) : each;
    out.push_back({"t." + std::to_string(i), DType::kU8, {static_cast<int64_t>(n)}});
  }
  return out;
}

uint64_t rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

Config pc_config(const Options& o, const std::string& endpoint) {
  Config c;
  c.control.endpoint = endpoint;
  c.control.join_timeout = std::chrono::seconds(120);
  c.data_plane.backend = o.backend;
  c.data_plane.bucket_bytes = o.bucket;
  c.data_plane.checksum = o.checksum;
  c.data_plane.stall_timeout = std::chrono::seconds(300);
  c.data_plane.init_timeout = std::chrono::seconds(120);
  c.publisher.subscriber_count = o.world - 1;
  c.publisher.device = device_for(o, 0);
  c.publisher.update_timeout = std::chrono::seconds(600);
  // Every byte of the synthetic model changes between versions: the dense
  // path is what is measured here (delta updates: bench/delta_bench.py).
  c.publisher.delta = DeltaMode::kOff;
  c.log_level = LogLevel::kWarn;
  if (o.backend == Backend::kNccl) {
    c.subscriber.devices.clear();
    for (int r = 1; r < o.world; ++r) c.subscriber.devices.push_back(device_for(o, r));
  }
  return c;
}

// Owns device buffers for one layout: one allocation per tensor, or (arena)
// one flat buffer with the tensors back to back (256-byte aligned) in order,
// as trainers keep flat parameter buffers and engines keep weight arenas.
struct Buffers {
  std::unique_ptr<DeviceMemory> mem;
  std::vector<StagingBuffer> bufs;
  std::vector<TensorView> views;
  Buffers(Device d, const std::vector<TensorSpec>& specs, uint8_t seed, bool arena) {
    mem = create_device_memory(d).value();
    std::vector<uint64_t> offsets;
    uint64_t total = 0;
    for (const auto& s : specs) {
      offsets.push_back(total);
      total = (total + s.nbytes().value() + kPackAlignment - 1) / kPackAlignment * kPackAlignment;
    }
    uint8_t* flat = nullptr;
    if (arena) {
      flat = static_cast<uint8_t*>(mem->allocate(total).value());
      bufs.emplace_back(mem.get(), flat, total);
    }
    std::vector<uint8_t> host;
    for (size_t i = 0; i < specs.size(); ++i) {
      const uint64_t n = specs[i].nbytes().value();
      void* p = arena ? flat + offsets[i] : mem->allocate(n).value();
      host.assign(n, 0);
      for (uint64_t j = 0; j < n; j += 4096) host[j] = static_cast<uint8_t>(j + seed);  // touch every page
      (void)mem->copy(p, host.data(), n);
      if (!arena) bufs.emplace_back(mem.get(), p, n);
      views.push_back(TensorView{specs[i], p, d});
    }
  }
};

struct Stats {
  double min = 0, median = 0, max = 0;
};
Stats stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return {};
  return {v.front(), v[v.size() / 2], v.back()};
}
double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

// ------------------------------------------------------------------ receiver
int run_receiver(const Options& o, int rank) {
  FileStore store(o.dir);
  const auto wait = std::chrono::seconds(600);
  const Device dev = device_for(o, rank);
  if (o.backend == Backend::kGloo) {  // (a0) the library's broadcast
    auto lib = bench::library_broadcast(rank, o.world, o.size, o.repeats, o.dir + "/libgloo");
    if (!lib.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, lib.status().to_string().c_str());
      return 1;
    }
  }
  {  // (a) raw
    GroupOptions g;
    g.epoch = 1;
    g.rank = rank;
    g.world_size = o.world;
    g.backend = o.backend;
    g.bootstrap = store.get("raw.bootstrap", wait).value();
    g.device = dev;
    g.op_timeout = std::chrono::seconds(300);
    auto comm = create_communicator(g, store);
    if (!comm.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, comm.status().to_string().c_str());
      return 1;
    }
    Buffers b(dev, {{"raw", DType::kU8, {static_cast<int64_t>(o.size)}}}, 0, false);
    for (int rep = 0; rep <= o.repeats; ++rep) {
      Status s = comm.value()->broadcast(b.views[0].data, o.size, 0)->wait(Clock::now() + std::chrono::seconds(300));
      if (!s.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", rank, s.to_string().c_str());
        return 1;
      }
      (void)store.set("raw.done." + std::to_string(rep) + "." + std::to_string(rank), "1");
    }
  }
  auto run_phase = [&](const std::string& phase, const std::vector<TensorSpec>& specs, int updates) -> int {
    const std::string endpoint = store.get(phase + ".endpoint", wait).value();
    Config cfg = pc_config(o, endpoint);
    Buffers b(dev, specs, 1, o.arena);
    const uint64_t rss0 = rss_bytes();
    auto sub = Subscriber::create(cfg, "bench-" + std::to_string(rank)).value();
    for (const auto& v : b.views)
      if (!sub->register_tensor(v).ok()) return 1;
    if (!sub->start().ok()) return 1;
    for (int u = 0; u < updates;) {
      auto r = sub->next_report(std::chrono::seconds(600));
      if (!r) return 1;
      if (!r->status.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", rank, r->status.to_string().c_str());
        return 1;
      }
      ++u;
    }
    const uint64_t growth = rss_bytes() > rss0 ? rss_bytes() - rss0 : 0;
    (void)store.set(phase + ".stats." + std::to_string(rank),
                    std::to_string(sub->staging_peak_bytes()) + " " + std::to_string(growth));
    (void)store.get(phase + ".over", wait);  // leave only after the publisher is done
    sub->stop();
    return 0;
  };
  for (int count : o.counts)
    if (int rc = run_phase("t" + std::to_string(count), layout(count, o.size), o.repeats + 1)) return rc;
  if (int rc = run_phase("latency", {{"tiny", DType::kF32, {1}}}, o.latency_updates + 10)) return rc;
  return run_phase("latency_round", {{"tiny", DType::kF32, {1}}}, o.latency_updates + 10);
}

// ---------------------------------------------------------------------- root
struct PhaseResult {
  int count = 0;
  uint64_t bytes = 0;
  size_t buckets = 0;
  Stats gbps;
  uint64_t root_staging = 0;
  uint64_t recv_staging = 0;
  uint64_t recv_rss_growth = 0;
};

// Everything the root measured, for the report.
struct RootFigures {
  std::vector<double> library;  // GB/s per repeat of gloo::broadcast (Gloo only)
  std::vector<double> raw;  // GB/s per repeat
  double memcpy_gbps = 0, pack_gbps = 0;
  std::vector<PhaseResult> phases;
  std::vector<double> lat, lat_round;  // seconds per 4-byte update
};

std::vector<std::unique_ptr<test::Process>> start_receivers(const Options& o, const std::string& self) {
  std::vector<std::unique_ptr<test::Process>> receivers;
  std::string counts;
  for (int c : o.counts) {
    if (!counts.empty()) counts += ",";
    counts += std::to_string(c);
  }
  for (int r = 1; r < o.world; ++r)
    receivers.push_back(test::Process::start(
        self,
        {"--role", "receiver", "--rank", std::to_string(r), "--dir", o.dir, "--backend", backend_name(o.backend),
         "--world", std::to_string(o.world), "--size", std::to_string(o.size), "--counts", counts, "--repeats",
         std::to_string(o.repeats), "--latency-updates", std::to_string(o.latency_updates), "--bucket",
         std::to_string(o.bucket), "--checksum", checksum_name(o.checksum), "--gpus",
         std::to_string(o.gpus), "--layout", o.arena ? "arena" : "separate"},
        // Ranks sharing a GPU must look like separate hosts to NCCL; on a
        // node with a GPU per rank NCCL must see one host (NVLink, P2P).
        o.gpus < o.world ? std::vector<std::string>{"NCCL_HOSTID=paramcast-bench-" + std::to_string(r)}
                         : std::vector<std::string>{}));
  return receivers;
}

constexpr auto kWait = std::chrono::seconds(600);

// (a) the raw broadcast of the same bytes: the baseline.
Status measure_raw(const Options& o, FileStore& store, std::vector<double>& raw) {
  auto boot = mint_bootstrap(o.backend, 1);
  if (!boot.ok()) return boot.status();
  (void)store.set("raw.bootstrap", *boot);
  GroupOptions g;
  g.epoch = 1;
  g.rank = 0;
  g.world_size = o.world;
  g.backend = o.backend;
  g.bootstrap = *boot;
  g.device = device_for(o, 0);
  g.op_timeout = std::chrono::seconds(300);
  auto comm = create_communicator(g, store);
  if (!comm.ok()) return comm.status();
  Buffers b(g.device, {{"raw", DType::kU8, {static_cast<int64_t>(o.size)}}}, 7, false);
  for (int rep = 0; rep <= o.repeats; ++rep) {
    const auto t0 = Clock::now();
    PC_RETURN_IF_ERROR(comm.value()->broadcast(b.views[0].data, o.size, 0)->wait(Clock::now() + std::chrono::seconds(300)));
    for (int r = 1; r < o.world; ++r)  // done when every receiver has the bytes
      if (!store.get("raw.done." + std::to_string(rep) + "." + std::to_string(r), kWait).ok())
        return unavailable("receiver " + std::to_string(r) + " never finished the raw broadcast");
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    if (rep > 0) raw.push_back(static_cast<double>(o.size) / secs / 1e9);  // rep 0 warms up
  }
  return Status();
}

// (e) pack throughput (10,000 pieces) vs one memcpy, on the root's device.
void measure_pack(const Options& o, RootFigures& f) {
  auto mem = create_device_memory(device_for(o, 0)).value();
  const uint64_t n = std::min<uint64_t>(o.size, 256ull << 20);
  StagingBuffer a(mem.get(), mem->allocate(n).value(), n), b(mem.get(), mem->allocate(n).value(), n);
  (void)mem->copy(b.data(), a.data(), n);
  std::vector<DeviceMemory::CopyOp> ops;
  const uint64_t piece = n / 10000;
  for (uint64_t off = 0; off + piece <= n; off += piece) ops.push_back({b.data() + off, a.data() + off, piece});
  std::vector<double> m, p;
  // Both timed to completion: on a GPU, copy_many only queues its kernels.
  (void)mem->synchronize();
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = Clock::now();
    (void)mem->copy(b.data(), a.data(), n);
    (void)mem->synchronize();
    m.push_back(static_cast<double>(n) / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9);
    t0 = Clock::now();
    (void)mem->copy_many(ops);
    (void)mem->synchronize();
    p.push_back(static_cast<double>(piece * ops.size()) / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9);
  }
  f.memcpy_gbps = stats(m).median;
  f.pack_gbps = stats(p).median;
}

// (b), (c) one phase of weight_updates through a real Publisher; `seconds`
// gets each update's time (latency phases), else the phase is recorded.
Status run_phase(const Options& o, FileStore& store, RootFigures& f, const std::string& phase,
                 const std::vector<TensorSpec>& specs, int updates, std::vector<double>* seconds,
                 bool reuse_validated_plan = true) {
  Config cfg = pc_config(o, "tcp://127.0.0.1:*");
  cfg.publisher.reuse_validated_plan = reuse_validated_plan;
  auto pub = Publisher::create(cfg);
  if (!pub.ok()) return pub.status();
  PC_RETURN_IF_ERROR(store.set(phase + ".endpoint", pub.value()->endpoint()));
  PC_RETURN_IF_ERROR(pub.value()->start());
  Buffers b(device_for(o, 0), specs, 3, o.arena);
  PhaseResult pr;
  std::vector<double> rates;
  for (int u = 0; u < updates; ++u) {
    UpdateResult r = pub.value()->weight_update(b.views);
    if (!r.ok()) return r.status;
    pr.bytes = r.bytes;
    pr.buckets = r.buckets;
    if (u > 0) {  // the first update warms up
      rates.push_back(r.gbps());
      if (seconds) seconds->push_back(r.seconds);
    }
  }
  pr.count = static_cast<int>(specs.size());
  pr.gbps = stats(rates);
  pr.root_staging = pub.value()->stats().staging_peak_bytes;
  for (int r = 1; r < o.world; ++r) {
    auto v = store.get(phase + ".stats." + std::to_string(r), kWait);
    if (!v.ok()) return v.status();
    std::istringstream in(*v);
    uint64_t staging = 0, growth = 0;
    in >> staging >> growth;
    pr.recv_staging = std::max(pr.recv_staging, staging);
    pr.recv_rss_growth = std::max(pr.recv_rss_growth, growth);
  }
  PC_RETURN_IF_ERROR(store.set(phase + ".over", "1"));
  pub.value()->shutdown();
  if (!seconds) f.phases.push_back(pr);
  return Status();
}

// Every measurement, in the order the receivers follow.
Status measure_all(const Options& o, FileStore& store, RootFigures& f) {
  if (o.backend == Backend::kGloo) {
    auto lib = bench::library_broadcast(0, o.world, o.size, o.repeats, o.dir + "/libgloo");
    if (!lib.ok()) return lib.status();
    f.library = *lib;
  }
  PC_RETURN_IF_ERROR(measure_raw(o, store, f.raw).with_context("raw broadcast"));
  measure_pack(o, f);
  for (int count : o.counts) {
    // std::string first: GCC 12 reports a false -Wrestrict for "literal" + std::string&& at -O3.
    const std::string n = std::to_string(count);
    PC_RETURN_IF_ERROR(run_phase(o, store, f, std::string("t") + n, layout(count, o.size), o.repeats + 1, nullptr)
                           .with_context(std::string("T=") + n));
  }
  // (c) latency of a 4-byte update; (c') the same with the accept round on every update
  const std::vector<TensorSpec> tiny = {{"tiny", DType::kF32, {1}}};
  PC_RETURN_IF_ERROR(run_phase(o, store, f, "latency", tiny, o.latency_updates + 10, &f.lat).with_context("latency"));
  PC_RETURN_IF_ERROR(run_phase(o, store, f, "latency_round", tiny, o.latency_updates + 10, &f.lat_round, false)
                         .with_context("latency (accept round)"));
  for (auto* lat : {&f.lat, &f.lat_round})  // 10 warm-up updates
    lat->erase(lat->begin(), lat->begin() + std::min<size_t>(lat->size(), 9));
  return Status();
}

struct Report {
  std::string date, host, machine;
  long cores = 0;
  Stats raw, library;
  double p50 = 0, p99 = 0, round_p50 = 0, round_p99 = 0;
};

Report describe(const RootFigures& f) {
  Report r;
  char date[32];
  std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  r.date = date;
  utsname u;
  uname(&u);
  r.machine = u.machine;
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  r.host = host;
  r.cores = sysconf(_SC_NPROCESSORS_ONLN);
  r.raw = stats(f.raw);
  r.library = stats(f.library);
  r.p50 = percentile(f.lat, 0.5) * 1e3;
  r.p99 = percentile(f.lat, 0.99) * 1e3;
  r.round_p50 = percentile(f.lat_round, 0.5) * 1e3;
  r.round_p99 = percentile(f.lat_round, 0.99) * 1e3;
  return r;
}

void print_report(const Options& o, const RootFigures& f, const Report& r) {
  const Stats& rs = r.raw;
  std::printf("paramcast-bench  %s  %s, %ld cores  backend %s  world %d  S=%s  bucket %s  checksum %s  layout %s\n",
              r.date.c_str(), r.machine.c_str(), r.cores, backend_name(o.backend), o.world,
              format_bytes(o.size).c_str(), format_bytes(o.bucket).c_str(), checksum_name(o.checksum),
              o.arena ? "arena" : "separate");
  const Stats& ls = r.library;
  if (ls.median > 0)
    std::printf("  gloo::broadcast (libgloo) %6.3f GB/s (min %.3f, max %.3f)\n", ls.median, ls.min, ls.max);
  std::printf("  raw broadcast            %7.3f GB/s (min %.3f, max %.3f)", rs.median, rs.min, rs.max);
  if (ls.median > 0) std::printf("  ratio vs libgloo %.3f", rs.median / ls.median);
  std::printf("\n");
  for (const auto& p : f.phases) {
    std::printf("  weight_update T=%-6d   %7.3f GB/s (min %.3f, max %.3f)  ratio %.3f", p.count, p.gbps.median,
                p.gbps.min, p.gbps.max, rs.median > 0 ? p.gbps.median / rs.median : 0);
    if (ls.median > 0) std::printf(" (vs libgloo %.3f)", p.gbps.median / ls.median);  // libgloo: the gloo backend only
    std::printf("  %zu buckets  staging root %s, receiver %s (RSS +%s)\n", p.buckets,
                format_bytes(p.root_staging).c_str(), format_bytes(p.recv_staging).c_str(),
                format_bytes(p.recv_rss_growth).c_str());
  }
  std::printf("  4-byte update latency    p50 %.3f ms  p99 %.3f ms  (%zu updates)\n", r.p50, r.p99, f.lat.size());
  std::printf("    with an accept round   p50 %.3f ms  p99 %.3f ms  (reuse_validated_plan: false)\n", r.round_p50,
              r.round_p99);
  std::printf("  pack (10,000 pieces)     %7.3f GB/s vs one memcpy %.3f GB/s: %.2f\n", f.pack_gbps, f.memcpy_gbps,
              f.memcpy_gbps > 0 ? f.pack_gbps / f.memcpy_gbps : 0);
  double r291 = 0, r1 = 0, r10k = 0;
  for (const auto& p : f.phases) {
    if (p.count == 291) r291 = p.gbps.median / rs.median;
    if (p.count == 1) r1 = p.gbps.median;
    if (p.count == 10000) r10k = p.gbps.median;
  }
  std::printf("SUMMARY %s world=%d S=%s: ratio(T=291)=%.3f  rate(T=10000)/rate(T=1)=%.3f  p50=%.3fms p99=%.3fms",
              backend_name(o.backend), o.world, format_bytes(o.size).c_str(), r291, r1 > 0 ? r10k / r1 : 0, r.p50,
              r.p99);
  if (ls.median > 0) std::printf("  raw/libgloo=%.3f", rs.median / ls.median);
  std::printf("\n");
}

void write_json(const Options& o, const RootFigures& f, const Report& r) {
  const Stats& rs = r.raw;
  const Stats& ls = r.library;
  std::ofstream j(o.json);
  j << "{\"date\":\"" << r.date << "\",\"host\":\"" << r.host << "\",\"machine\":\"" << r.machine << " " << r.cores
    << " cores\",\"backend\":\"" << backend_name(o.backend) << "\",\"world\":" << o.world << ",\"bytes\":" << o.size
    << ",\"bucket_bytes\":" << o.bucket << ",\"checksum\":\"" << (checksum_name(o.checksum)) << "\",\"layout\":\""
    << (o.arena ? "arena" : "separate") << "\",\"raw_gbps\":{\"min\":" << rs.min << ",\"median\":" << rs.median
    << ",\"max\":" << rs.max << "}";
  if (ls.median > 0)
    j << ",\"library_gbps\":{\"min\":" << ls.min << ",\"median\":" << ls.median << ",\"max\":" << ls.max
      << "},\"raw_vs_library\":" << rs.median / ls.median;
  j << ",\"updates\":[";
  for (size_t i = 0; i < f.phases.size(); ++i) {
    const auto& p = f.phases[i];
    j << (i ? "," : "") << "{\"tensors\":" << p.count << ",\"bytes\":" << p.bytes << ",\"buckets\":" << p.buckets
      << ",\"gbps\":{\"min\":" << p.gbps.min << ",\"median\":" << p.gbps.median << ",\"max\":" << p.gbps.max
      << "},\"ratio_vs_raw\":" << (rs.median > 0 ? p.gbps.median / rs.median : 0)
      << ",\"ratio_vs_library\":" << (ls.median > 0 ? p.gbps.median / ls.median : 0)
      << ",\"staging_root_bytes\":" << p.root_staging << ",\"staging_receiver_bytes\":" << p.recv_staging
      << ",\"receiver_rss_growth_bytes\":" << p.recv_rss_growth << "}";
  }
  j << "],\"latency_ms\":{\"p50\":" << r.p50 << ",\"p99\":" << r.p99 << ",\"updates\":" << f.lat.size()
    << "},\"latency_accept_round_ms\":{\"p50\":" << r.round_p50 << ",\"p99\":" << r.round_p99
    << "},\"pack_gbps\":" << f.pack_gbps << ",\"memcpy_gbps\":" << f.memcpy_gbps << "}\n";
}

int run_root(Options o, const std::string& self) {
  char tmpl[] = "/tmp/paramcast-bench-XXXXXX";
  o.dir = mkdtemp(tmpl);
  if (mkdir((o.dir + "/libgloo").c_str(), 0700) != 0) {
    std::fprintf(stderr, "paramcast-bench: cannot create %s/libgloo\n", o.dir.c_str());
    return 1;
  }
  FileStore store(o.dir);
  auto receivers = start_receivers(o, self);
  RootFigures f;
  Status s = measure_all(o, store, f);
  for (auto& p : receivers)
    if (s.ok() && p->wait_for(std::chrono::seconds(60)) != 0) s = internal_error("a receiver failed");
  if (!s.ok()) {
    std::fprintf(stderr, "paramcast-bench: %s\n", s.to_string().c_str());
    for (auto& p : receivers) std::fprintf(stderr, "%s", p->output().c_str());
    return 1;
  }
  const Report r = describe(f);
  print_report(o, f, r);
  if (!o.json.empty()) write_json(o, f, r);
  test::remove_tree(o.dir);
  return 0;
}

const Tool kTool{
    .name = "paramcast-bench",
    .usage = "usage: paramcast-bench [--backend gloo|nccl|shm] [--world 8] [--size 1GiB] [--counts 1,291,10000]\n"
             "                       [--repeats 3] [--latency-updates 200] [--bucket 256MiB]\n"
             "                       [--checksum none|xxh64|xxh64-blocks] [--layout separate|arena] [--gpus N]\n"
             "                       [--json FILE]\n"
             "\n"
             "weight_update against the raw backend broadcast of the same bytes (and, on\n"
             "gloo, against libgloo's gloo::broadcast), on one machine: this process is\n"
             "rank 0, the other ranks are this program re-executed.\n"
             "\n"
             "  --backend gloo|nccl|shm  data plane (default gloo; shm: every rank on this host)\n"
             "  --world N                ranks, this one included (default 8)\n"
             "  --size SIZE              bytes per update (default 1GiB)\n"
             "  --counts N,...           tensor counts to split SIZE into (default 1,291,10000)\n"
             "  --repeats N              timed runs per case (default 3)\n"
             "  --latency-updates N      4-byte updates for the latency figures (default 200)\n"
             "  --bucket SIZE            bucket size (default 256MiB)\n"
             "  --checksum none|xxh64    per-bucket checksums (default none)\n"
             "  --layout separate|arena  one allocation per tensor, or one flat buffer\n"
             "  --gpus N                 GPUs to spread the ranks over (nccl; default 1)\n"
             "  --json FILE              also write the results as JSON to FILE\n"
             "  -h, --help               print this and exit\n",
    // role, rank and dir: how the root starts the receivers (not for people).
    .value_flags = {"backend", "world", "size", "counts", "repeats", "latency-updates", "bucket", "checksum",
                    "layout", "gpus", "json", "role", "rank", "dir"},
};

}  // namespace

int main(int argc, char** argv) {
  Flags f = parse_flags(argc, argv, 1, kTool);
  if (auto code = finish_flags(f, kTool)) return *code;
  if (!f.positional.empty()) return usage_error(kTool, "unexpected argument '" + f.positional[0] + "'");
  Options o;
  if (f.get("backend", "gloo") == "nccl") o.backend = Backend::kNccl;
  if (f.get("backend", "gloo") == "shm") o.backend = Backend::kShm;
  o.world = std::atoi(f.get("world", "8").c_str());
  o.size = parse_size(f.get("size", "1GiB")).value_or(0);
  o.repeats = std::atoi(f.get("repeats", "3").c_str());
  o.latency_updates = std::atoi(f.get("latency-updates", "200").c_str());
  o.bucket = parse_size(f.get("bucket", "256MiB")).value_or(256ull << 20);
  const std::string checksum = f.get("checksum", "none");
  o.checksum = checksum == "xxh64"          ? Checksum::kXxh64
               : checksum == "xxh64-blocks" ? Checksum::kXxh64Blocks
                                            : Checksum::kNone;
  o.json = f.get("json");
  o.gpus = std::atoi(f.get("gpus", "1").c_str());
  o.arena = f.get("layout", "separate") == "arena";
  if (f.has("counts")) {
    o.counts.clear();
    std::stringstream ss(f.get("counts"));
    for (std::string c; std::getline(ss, c, ',');) o.counts.push_back(std::atoi(c.c_str()));
  }
  if (o.world < 2) return usage_error(kTool, "--world must be at least 2");
  if (o.size == 0) return usage_error(kTool, "bad --size '" + f.get("size") + "'");
  if (o.repeats < 1) return usage_error(kTool, "--repeats must be at least 1");
  set_log_level(LogLevel::kWarn);
  if (f.get("role") == "receiver") {
    o.dir = f.get("dir");
    return run_receiver(o, std::atoi(f.get("rank").c_str()));
  }
  if (o.backend == Backend::kNccl && o.gpus < 1) o.gpus = 1;
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  self[n > 0 ? n : 0] = 0;
  return run_root(o, self);
}
