// reshard_rank: one rank of a many-sender job, as its own process. Ranks
// 0..M-1 are trainer ranks holding a LLaMA-shaped model laid out as
// --layout says (fsdp: every matrix Shard(0), uneven, norms replicated;
// megatron: column-parallel weights Shard(0), row-parallel Shard(1);
// pipeline: each layer whole on one rank); ranks M.. are R replicas x TP
// engine ranks wanting their tensor-parallel slices (column-parallel and
// vocab-parallel weights cut along dim 0, row-parallel along dim 1, norms
// whole). Every rank builds the same manifests, plans, schedules and runs
// its transfers over a Gloo group (FileStore rendezvous); engines verify
// every element of what they want against the generator.
// --memory cpu: the run goes round by round over a DeviceMemory of host
// memory (RunOptions::memory, the device path's logic on Gloo); --memory
// cuda: over NCCL, the buffers in --device's memory (--bootstrap-hex: the
// ncclUniqueId). --checksums 1: every piece followed by its checksum.
// Exit: 0 ok, 1 wrong bytes, 2 usage or plan refused, 3 the run failed.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>

#include "common/cli.h"
#include "common/data/bucket_checksum.h"
#include "common/data/communicator.h"
#include "common/data/device_memory.h"
#include "common/data/file_store.h"
#include "common/reshard/executor.h"
#include "common/xxhash.h"

using namespace paramcast;
using namespace paramcast::reshard;

namespace {

// --corrupt-rank R (host memory): rank R's first piece of more than 8 bytes
// leaves with one byte flipped, as a bad link or a hostile sender would send
// it; its checksum is the true one. --forge-rank R: the same, and any
// checksum R sends for that piece is the flipped bytes' (a hostile member
// that changes a piece it forwards and vouches for it), in the checksum the
// run uses (xxh64; xxh64-blocks round by round). Wraps the real
// communicator.
class FlipFirstPiece : public Communicator {
 public:
  FlipFirstPiece(std::unique_ptr<Communicator> real, bool forge, Checksum kind)
      : real_(std::move(real)), forge_(forge), kind_(kind) {}
  std::shared_ptr<Work> broadcast(void* data, size_t bytes, int root) override {
    return real_->broadcast(data, bytes, root);
  }
  std::shared_ptr<Work> send(const void* data, size_t bytes, int peer, uint32_t tag) override {
    if (forge_ && flipped_ && tag == (tag_ | kChecksumTag) && bytes == sizeof forged_)
      return real_->send(&forged_, bytes, peer, tag);
    if (flipped_ || bytes <= 8 || (tag & (kChecksumTag | kHeaderTag))) return real_->send(data, bytes, peer, tag);
    flipped_ = true;
    tag_ = tag;
    copy_.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + bytes);
    copy_[bytes / 2] ^= 0x10;
    forged_ = host_checksum(kind_, copy_.data(), copy_.size());
    return real_->send(copy_.data(), bytes, peer, tag);
  }
  std::shared_ptr<Work> recv(void* data, size_t bytes, int peer, uint32_t tag) override {
    return real_->recv(data, bytes, peer, tag);
  }
  void begin_moves() override { real_->begin_moves(); }
  Status end_moves() override { return real_->end_moves(); }
  void abort(const std::string& reason) override { real_->abort(reason); }
  Status async_error() override { return real_->async_error(); }
  int rank() const override { return real_->rank(); }
  int world_size() const override { return real_->world_size(); }
  Device device() const override { return real_->device(); }

 private:
  std::unique_ptr<Communicator> real_;
  const bool forge_;
  const Checksum kind_;
  bool flipped_ = false;
  uint32_t tag_ = 0;
  uint64_t forged_ = 0;
  std::vector<uint8_t> copy_;
};

struct Layer {
  TensorSpec spec;
  int tp_dim;  // -1: whole on every engine rank
};

// --hidden H, --layers L (5 tensors a layer, 2 more).
std::vector<Layer> model(int64_t H, int layers) {
  const int64_t I = H * 43 / 16, V = H * 16;
  std::vector<Layer> m = {{{"model.embed_tokens.weight", DType::kBF16, {V, H}}, 0}};
  for (int l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    m.push_back({{p + "self_attn.q_proj.weight", DType::kBF16, {H, H}}, 0});
    m.push_back({{p + "self_attn.o_proj.weight", DType::kBF16, {H, H}}, 1});
    m.push_back({{p + "mlp.gate_proj.weight", DType::kBF16, {I, H}}, 0});
    m.push_back({{p + "mlp.down_proj.weight", DType::kBF16, {H, I}}, 1});
    m.push_back({{p + "input_layernorm.weight", DType::kF32, {H}}, -1});
  }
  m.push_back({{"lm_head.weight", DType::kBF16, {V, H}}, 0});
  return m;
}

// torch.chunk's split of n into k: ceil-sized, the last short or empty.
std::pair<int64_t, int64_t> chunk(int64_t n, int k, int i) {
  const int64_t per = (n + k - 1) / k, start = std::min<int64_t>(n, per * i);
  return {start, std::min<int64_t>(per, n - start)};
}

uint8_t byte_at(const std::string& tensor, uint64_t byte, uint64_t seed = 0) {
  const uint64_t h = xxh64(tensor.data(), tensor.size(), (byte / 8) ^ (seed << 40));
  return static_cast<uint8_t>(h >> (8 * (byte % 8)));
}

// Version v of a tensor (--delta-steps): from version 2 on, about one
// element in 50 changes at each version (as an optimizer step that leaves
// most BF16 elements as they were); an element holds the bytes of the last
// version that changed it.
uint64_t last_change(const std::string& tensor, uint64_t element, uint64_t version) {
  for (uint64_t w = version; w >= 2; --w)
    if (xxh64(tensor.data(), tensor.size(), element ^ (w << 48)) % 50 == 0) return w;
  return 0;
}

// Fills (or checks) the buffer of `box` of a tensor at `version`: returns
// the first bad byte's index in the buffer, or -1.
int64_t fill_or_check(const TensorSpec& t, const Region& box, uint8_t* data, bool fill, uint64_t version = 1) {
  const size_t e = dtype_size(t.dtype);
  const Region whole = Region::whole(t.shape);
  std::vector<uint8_t> global(t.nbytes().value());
  for (uint64_t i = 0; i < global.size(); ++i) global[i] = byte_at(t.name, i, last_change(t.name, i / e, version));
  if (fill) {
    copy_region(global.data(), whole, data, box, box, e);
    return -1;
  }
  std::vector<uint8_t> want(box.elements() * e);
  copy_region(global.data(), whole, want.data(), box, box, e);
  for (uint64_t i = 0; i < want.size(); ++i)
    if (data[i] != want[i]) return static_cast<int64_t>(i);
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f = parse_flags(argc, argv, 1);
  const int senders = std::atoi(f.get("senders", "2").c_str());
  const int replicas = std::atoi(f.get("replicas", "1").c_str());
  const int tp = std::atoi(f.get("tp", "1").c_str());
  const std::string layout = f.get("layout", "fsdp");
  const std::string memory = f.get("memory", "host");
  if (memory != "host" && (f.get("mode") == "funnel" || std::atoi(f.get("delta-steps", "0").c_str()) > 0)) {
    std::fprintf(stderr, "--memory %s runs dense plans only (no --mode funnel, no --delta-steps)\n", memory.c_str());
    return 2;
  }
  if (memory == "cuda" && (f.get("corrupt-rank", "-1") != "-1" || f.get("forge-rank", "-1") != "-1")) {
    std::fprintf(stderr, "--corrupt-rank flips a byte in host memory only\n");
    return 2;
  }
  GroupOptions g;
  g.backend = memory == "cuda" ? Backend::kNccl : Backend::kGloo;
  g.rank = std::atoi(f.get("rank").c_str());
  g.world_size = senders + replicas * tp;
  g.epoch = 1;
  g.bootstrap = f.get("bootstrap");
  if (f.has("bootstrap-hex")) {
    const std::string h = f.get("bootstrap-hex");
    g.bootstrap.clear();
    for (size_t i = 0; i + 1 < h.size(); i += 2)
      g.bootstrap.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
  }
  g.device = memory == "cuda" ? parse_device(f.get("device", "cuda:0")).value() : Device::cpu();
  g.init_timeout = std::chrono::seconds(60);
  g.gloo_hostname = f.get("host", "127.0.0.1");
  for (int r = 0; r < g.world_size; ++r)
    g.members.push_back(r < senders ? "trainer-" + std::to_string(r) : "engine-" + std::to_string(r - senders));

  // The same manifests on every rank.
  const auto layers = model(std::atoll(f.get("hidden", "64").c_str()), std::atoi(f.get("layers", "2").c_str()));
  std::vector<TensorSpec> specs;
  for (const auto& l : layers) specs.push_back(l.spec);
  std::vector<RankManifest> ranks;
  for (int s = 0; s < senders; ++s) ranks.push_back({s, g.members[static_cast<size_t>(s)], specs, {}, {}});
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& t = layers[i].spec;
    for (int s = 0; s < senders; ++s) {
      Region box;
      if (layout == "pipeline") {
        if (static_cast<int>(i % static_cast<size_t>(senders)) != s) continue;
        box = Region::whole(t.shape);
      } else if (t.shape.size() == 1) {
        box = Region::whole(t.shape);  // replicated norms
      } else {
        const int dim = layout == "megatron" && layers[i].tp_dim == 1 ? 1 : 0;
        auto [start, len] = chunk(t.shape[static_cast<size_t>(dim)], senders, s);
        if (len == 0) continue;
        box = Region::slice(t.shape, dim, start, len);
      }
      ranks[static_cast<size_t>(s)].holds.push_back({t.name, box});
    }
  }
  for (int e = 0; e < replicas * tp; ++e) {
    RankManifest m{senders + e, g.members[static_cast<size_t>(senders + e)], specs, {}, {}};
    const int k = e % tp;
    for (const auto& l : layers) {
      if (l.tp_dim < 0 || tp == 1) {
        m.wants.push_back({l.spec.name, Region::whole(l.spec.shape)});
        continue;
      }
      auto [start, len] = chunk(l.spec.shape[static_cast<size_t>(l.tp_dim)], tp, k);
      if (len > 0) m.wants.push_back({l.spec.name, Region::slice(l.spec.shape, l.tp_dim, start, len)});
    }
    ranks.push_back(m);
  }
  // --mode funnel: today's path for a sharded trainer, as a baseline: rank 0
  // gathers every tensor (full_tensor()), then sends each whole tensor to
  // every engine (with 2 engines, what the binomial broadcast's root sends).
  const bool funnel = f.get("mode") == "funnel";
  std::vector<RankManifest> gather = ranks, publish = ranks;
  if (funnel) {
    for (auto& m : gather) m.wants.clear();
    for (const auto& t : specs) gather[0].wants.push_back({t.name, Region::whole(t.shape)});
    for (size_t r = 0; r < publish.size(); ++r) {
      publish[r].holds.clear();
      if (static_cast<int>(r) >= senders) {
        publish[r].wants.clear();
        for (const auto& t : specs) publish[r].wants.push_back({t.name, Region::whole(t.shape)});
      }
    }
    for (const auto& t : specs) publish[0].holds.push_back({t.name, Region::whole(t.shape)});
  }
  auto plan = plan_reshard(funnel ? gather : ranks, ReshardOptions{!funnel && f.get("forward", "1") == "1"});
  auto second = plan_reshard(funnel ? publish : ranks, ReshardOptions{false});
  if (!plan.ok() || !second.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", g.rank, (plan.ok() ? second : plan).status().to_string().c_str());
    return 2;
  }
  const auto rounds = schedule_rounds(*plan);
  const auto second_rounds = schedule_rounds(*second);
  if (g.rank == 0)
    std::printf("plan: %zu transfers in %zu rounds; busiest link %llu bytes, least possible %llu, schedule %llu\n",
                plan->transfers.size(), rounds.size(), static_cast<unsigned long long>(plan->busiest_bytes()),
                static_cast<unsigned long long>(plan->least_busiest_bytes),
                static_cast<unsigned long long>(schedule_bytes(rounds)));
  // Per rank: what its link carries each way (both phases for the funnel).
  auto link = [&](const ReshardPlan& p, int r, bool out) -> uint64_t {
    const auto& m = out ? p.sent : p.received;
    return m.count(r) ? m.at(r) : 0;
  };
  const uint64_t link_out = link(*plan, g.rank, true) + (funnel ? link(*second, g.rank, true) : 0);
  const uint64_t link_in = link(*plan, g.rank, false) + (funnel ? link(*second, g.rank, false) : 0);

  // This rank's buffers: what it holds, filled; what it wants, to fill.
  const RankManifest& me = ranks[static_cast<size_t>(g.rank)];
  // The funnel's rank 0 gathers whole tensors; its engines want them whole.
  const RankManifest& my_wants = funnel ? (g.rank == 0 ? gather[0] : publish[static_cast<size_t>(g.rank)]) : me;
  std::map<std::string, std::pair<Region, std::vector<uint8_t>>> held, wanted;
  std::map<std::string, const TensorSpec*> by_name;
  for (const auto& t : specs) by_name[t.name] = &t;
  for (const auto& h : me.holds) {
    auto& [box, bytes] = held[h.tensor];
    box = h.region;
    bytes.resize(box.elements() * dtype_size(by_name[h.tensor]->dtype));
    fill_or_check(*by_name[h.tensor], box, bytes.data(), true);
  }
  for (const auto& w : my_wants.wants) {
    auto& [box, bytes] = wanted[w.tensor];
    box = w.region;
    bytes.assign(box.elements() * dtype_size(by_name[w.tensor]->dtype), 0xEE);
  }
  auto wanted_funnel = [&](const std::string& name) -> std::pair<Region, std::vector<uint8_t>>& {
    return wanted[name];
  };
  // --memory: the buffers in the run's memory (host vectors for cpu; the
  // GPU's, filled from and checked through the host vectors, for cuda).
  std::unique_ptr<DeviceMemory> mem;
  std::map<std::string, void*> on_device;  // by tensor, held and wanted (a rank holds or wants each once)
  if (memory != "host") {
    auto m = create_device_memory(g.device);
    if (!m.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", g.rank, m.status().to_string().c_str());
      return 3;
    }
    mem = std::move(*m);
    if (memory == "cuda")
      for (auto* m2 : {&held, &wanted})
        for (auto& [name, bb] : *m2) {
          void* d = mem->allocate(std::max<size_t>(bb.second.size(), 1)).value();
          (void)mem->copy(d, bb.second.data(), bb.second.size());
          on_device[name] = d;
        }
  }
  auto copy_back = [&] {
    for (auto& [name, bw] : wanted)
      if (on_device.count(name)) (void)mem->copy(bw.second.data(), on_device[name], bw.second.size());
  };
  RankBuffers buffers;
  buffers.find = [&](size_t, const TensorSpec& t, const Region& region) -> LocalBuffer {
    const std::string& name = t.name;
    for (auto* m : {&held, &wanted}) {
      auto it = m->find(name);
      if (it != m->end() && intersect(it->second.first, region) == region) {
        uint8_t* data = it->second.second.data();
        if (auto d = on_device.find(name); d != on_device.end()) data = static_cast<uint8_t*>(d->second);
        return {data, it->second.first};
      }
    }
    return {};
  };

  FileStore store(f.get("store"));
  auto comm = create_communicator(g, store);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", g.rank, comm.status().to_string().c_str());
    return 3;
  }
  if (f.get("corrupt-rank") == std::to_string(g.rank) || f.get("forge-rank") == std::to_string(g.rank))
    comm = std::unique_ptr<Communicator>(
        new FlipFirstPiece(std::move(comm.value()), f.get("forge-rank") == std::to_string(g.rank),
                           memory == "host" ? Checksum::kXxh64 : Checksum::kXxh64Blocks));
  // Every rank formed before any moves: a rank whose transfers end early
  // must not leave while another still connects its pair to it (the mesh is
  // full). Each tells rank 0, which then releases them all.
  {
    std::vector<uint8_t> bytes(static_cast<size_t>(g.world_size) + 1, 1);
    uint8_t* scratch = bytes.data();  // the communicator's memory
    if (memory == "cuda") {
      scratch = static_cast<uint8_t*>(mem->allocate(bytes.size()).value());
      (void)mem->copy(scratch, bytes.data(), bytes.size());
    }
    uint8_t& byte = scratch[g.world_size];
    Communicator& c = *comm.value();
    Status formed;
    const Deadline by = Clock::now() + std::chrono::seconds(60);
    if (g.rank == 0) {
      std::vector<std::shared_ptr<Work>> works;
      c.begin_moves();
      for (int r = 1; r < g.world_size; ++r)
        works.push_back(c.recv(&scratch[r], 1, r, 0x7fff0000u + static_cast<uint32_t>(r)));
      formed = c.end_moves();
      for (auto& w : works)
        if (formed.ok()) formed = w->wait(by);
    } else {
      formed = c.send(&byte, 1, 0, 0x7fff0000u + static_cast<uint32_t>(g.rank))->wait(by);
    }
    if (formed.ok()) formed = c.broadcast(&byte, 1, 0)->wait(by);
    if (!formed.ok()) {
      std::printf("rank %d: %s\n", g.rank, formed.to_string().c_str());
      return 3;
    }
  }
  const auto t0 = Clock::now();
  const Deadline deadline = t0 + std::chrono::seconds(std::atoi(f.get("timeout-s", "120").c_str()));
  // --delta-steps N: the first run records each sender's baseline; N more
  // versions follow as deltas against the one before.
  const int delta_steps = std::atoi(f.get("delta-steps", "0").c_str());
  SentBaseline sent_baseline;
  RunOptions first;
  first.version = 1;
  first.staging_limit = std::strtoull(f.get("staging-limit", "0").c_str(), nullptr, 10);
  first.checksums = f.get("checksums", "0") == "1";
  first.memory = mem.get();
  if (delta_steps > 0) first.sent = &sent_baseline;
  RunOptions::Stats first_stats;
  first.stats = &first_stats;
  Status s = run_reshard(*plan, rounds, g.rank, *comm.value(), buffers, deadline, first);
  if (s.ok()) {
    size_t mine = 0;
    for (const auto& x : plan->transfers) mine += x.from == g.rank || x.to == g.rank;
    std::printf("rank %d: %zu transfers in %zu messages\n", g.rank, mine, first_stats.messages);
  }
  if (s.ok() && mem) copy_back();
  if (s.ok() && funnel) {
    if (g.rank == 0)  // full_tensor(): its own shard joins the gathered bytes
      for (auto& [name, hb] : held) {
        auto& whole = wanted_funnel(name);
        copy_region(hb.second.data(), hb.first, whole.second.data(), whole.first, hb.first,
                    dtype_size(by_name[name]->dtype));
      }
    s = run_reshard(*second, second_rounds, g.rank, *comm.value(), buffers, deadline);
  }
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!s.ok()) {
    std::printf("rank %d: %s\n", g.rank, s.to_string().c_str());
    return 3;
  }
  std::printf("rank %d: moved in %.3f s; link out %llu, in %llu bytes\n", g.rank, took,
              static_cast<unsigned long long>(link_out), static_cast<unsigned long long>(link_in));
  uint64_t want_bytes = 0;
  for (auto& [name, bw] : wanted) {
    want_bytes += bw.second.size();
    const int64_t bad = fill_or_check(*by_name[name], bw.first, bw.second.data(), false);
    if (bad >= 0) {
      std::printf("rank %d: '%s' %s differs at byte %lld\n", g.rank, name.c_str(), bw.first.to_string().c_str(),
                  static_cast<long long>(bad));
      return 1;
    }
  }
  // --repeats N (host memory, dense): N more versions of the same plan,
  // each whole; the rank's schedule kept from the first run (RunOptions::
  // schedule) is used again while the options match and derived afresh when
  // checksums flip. Each says which, and is checked bit for bit.
  std::shared_ptr<const reshard::detail::RankSchedule> kept;
  const int repeats = std::atoi(f.get("repeats", "0").c_str());
  for (int v = 2; v <= repeats + 1; ++v) {
    for (auto& [name, hb] : held) fill_or_check(*by_name[name], hb.first, hb.second.data(), true, v);
    RunOptions again;
    again.version = static_cast<uint64_t>(v);
    again.checksums = v == repeats + 1 ? !first.checksums : first.checksums;
    again.schedule = &kept;
    const void* before = kept.get();
    if (Status r = run_reshard(*plan, rounds, g.rank, *comm.value(), buffers, deadline, again); !r.ok()) {
      std::printf("rank %d: repeat v%d: %s\n", g.rank, v, r.to_string().c_str());
      return 3;
    }
    for (auto& [name, bw] : wanted)
      if (const int64_t bad = fill_or_check(*by_name[name], bw.first, bw.second.data(), false, v); bad >= 0) {
        std::printf("rank %d: repeat v%d: '%s' differs at byte %lld\n", g.rank, v, name.c_str(),
                    static_cast<long long>(bad));
        return 1;
      }
    std::printf("rank %d: repeat v%d: schedule %s\n", g.rank, v,
                before == nullptr ? "new" : before == kept.get() ? "kept" : "derived again");
  }
  // The delta steps: senders refill their shards at version v; every
  // engine must end with exactly version v, having received far fewer bytes.
  for (int v = 2; v <= delta_steps + 1; ++v) {
    for (auto& [name, hb] : held) fill_or_check(*by_name[name], hb.first, hb.second.data(), true, v);
    if (v == 2 && f.get("corrupt-base") == std::to_string(g.rank))
      for (auto& [name, bw] : wanted)  // this engine does not hold v1 any more
        if (!bw.second.empty()) bw.second[bw.second.size() / 2] ^= 0x5a;
    RunOptions step;
    step.staging_limit = first.staging_limit;
    step.delta_base = static_cast<uint64_t>(v - 1);
    step.version = static_cast<uint64_t>(v);
    step.sent = held.empty() ? nullptr : &sent_baseline;
    RunOptions::Stats stats;
    step.stats = &stats;
    if (Status d = run_reshard(*plan, rounds, g.rank, *comm.value(), buffers, deadline, step); !d.ok()) {
      std::printf("rank %d: delta v%d: %s\n", g.rank, v, d.to_string().c_str());
      return 3;
    }
    for (auto& [name, bw] : wanted)
      if (const int64_t bad = fill_or_check(*by_name[name], bw.first, bw.second.data(), false, v); bad >= 0) {
        std::printf("rank %d: delta v%d: '%s' %s differs at byte %lld\n", g.rank, v, name.c_str(),
                    bw.first.to_string().c_str(), static_cast<long long>(bad));
        return 1;
      }
    std::printf("rank %d: delta v%d: wire out %llu, wire in %llu; %zu delta, %zu dense, %zu unchanged; baseline %llu "
                "bytes\n",
                g.rank, v, static_cast<unsigned long long>(stats.wire_sent),
                static_cast<unsigned long long>(stats.wire_received), stats.delta, stats.dense, stats.unchanged,
                static_cast<unsigned long long>(sent_baseline.bytes()));
  }
  const auto sent = plan->sent.count(g.rank) ? plan->sent.at(g.rank) : 0;
  const auto got = plan->received.count(g.rank) ? plan->received.at(g.rank) : 0;
  std::printf("rank %d: sent %llu, received %llu, wanted %llu bytes; verified\n", g.rank,
              static_cast<unsigned long long>(sent), static_cast<unsigned long long>(got),
              static_cast<unsigned long long>(want_bytes));
  return 0;
}
