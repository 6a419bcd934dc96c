// transfer_rank: one rank of the transfer-pipeline tests, run as its own
// process over a real Gloo communicator (FileStore rendezvous in --store).
// Rank 0 sends one update with BucketSender; the others receive it with
// BucketReceiver, each in its own mode, and verify every byte:
//   rank % 3 == 1  registered destinations, separate allocations (staging + unpack)
//   rank % 3 == 2  no destinations: the tensor callback (staging, assembly of chunks)
//   rank % 3 == 0  registered destinations laid out in bucket layout (in place)
// The tensor set crosses bucket boundaries and has a direct tensor and one
// larger than a bucket (chunked). --root-layout arena makes the sender's
// tensors lie in bucket layout too. With --checksum, the root publishes each
// bucket's xxh64 through the store; --corrupt-last flips a bit of the last
// bucket on rank 1.
// Exit: 0 verified, 1 wrong bytes, 2 usage, 3 communicator, 5 transfer failed.
#include <cstdio>
#include <map>

#include "common/cli.h"
#include "common/data/communicator.h"
#include "common/data/device_memory.h"
#include "common/data/file_store.h"
#include "common/transfer/bucket_receiver.h"
#include "common/transfer/bucket_sender.h"

using namespace paramcast;

namespace {
uint8_t pattern(uint32_t tensor, uint64_t i) { return static_cast<uint8_t>((i * 131 + tensor * 977) >> 2); }

std::vector<TensorSpec> tensor_set() {
  std::vector<TensorSpec> specs;
  specs.push_back({"direct", DType::kU8, {20000}});    // >= direct_min: alone, straight
  specs.push_back({"chunked", DType::kU8, {200000}});  // > bucket: four direct chunks
  // Sizes in whole 256-byte units: packed back to back, a bucket tiles exactly
  // (the in-place condition); the bytes still cross bucket boundaries.
  for (int i = 0; i < 60; ++i) specs.push_back({"small." + std::to_string(i), DType::kU8, {256 * (1 + (i * 7) % 15)}});
  return specs;
}

DataPlaneOptions layout() {
  DataPlaneOptions o;
  o.bucket_bytes = 64 << 10;
  o.direct_min_bytes = 16 << 10;
  return o;
}

// Buffers for every tensor: separate allocations, or bucket layout (an arena per packed bucket).
std::vector<std::vector<uint8_t>> allocate(const UpdatePlan& plan, bool arena, std::vector<void*>& at) {
  std::vector<std::vector<uint8_t>> storage;
  at.assign(plan.tensors.size(), nullptr);
  for (const auto& b : plan.buckets) {
    if (b.direct || !arena) continue;
    storage.emplace_back(b.bytes);
    for (const auto& p : b.pieces) at[p.tensor] = storage.back().data() + p.bucket_offset;
  }
  for (size_t t = 0; t < plan.tensors.size(); ++t)
    if (!at[t]) {
      storage.emplace_back(std::max<uint64_t>(1, plan.nbytes[t]));
      at[t] = storage.back().data();
    }
  return storage;
}

int fail(int rank, const std::string& what, int code) {
  std::printf("rank %d: %s\n", rank, what.c_str());
  return code;
}
}  // namespace

int main(int argc, char** argv) {
  Flags f = parse_flags(argc, argv, 1, std::vector<std::string>{"checksum", "corrupt-last"});
  GroupOptions g;
  g.rank = std::atoi(f.get("rank").c_str());
  g.world_size = std::atoi(f.get("world").c_str());
  g.epoch = 1;
  g.bootstrap = f.get("prefix");
  g.op_timeout = std::chrono::seconds(30);
  g.init_timeout = std::chrono::seconds(60);
  if (g.world_size < 2 || f.get("store").empty()) return fail(g.rank, "usage: --rank R --world W --store DIR --prefix P", 2);
  FileStore store(f.get("store"));
  if (f.get("backend") == "shm") {  // rank 0 mints the shm plane's bootstrap, the others read it
    g.backend = Backend::kShm;
    g.shm_slot_bytes = 64 << 10;  // many chunks per bucket: the ring wraps within every broadcast
    const std::string key = f.get("prefix") + "/shm-bootstrap";
    if (g.rank == 0) {
      g.bootstrap = mint_bootstrap(Backend::kShm, 1).value();
      if (!store.set(key, g.bootstrap).ok()) return fail(g.rank, "cannot write the shm bootstrap", 3);
    } else {
      auto b = store.get(key, std::chrono::seconds(60));
      if (!b.ok()) return fail(g.rank, b.status().to_string(), 3);
      g.bootstrap = *b;
    }
  }
  auto comm = create_communicator(g, store);
  if (!comm.ok()) return fail(g.rank, comm.status().to_string(), 3);
  std::printf("rank %d: backend %s\n", g.rank, backend_name(g.backend));
  auto mem = create_device_memory(Device::cpu()).value();
  DataPlaneOptions opts = layout();
  opts.checksum = f.has("checksum") ? Checksum::kXxh64 : Checksum::kNone;
  auto plan = build_plan(1, tensor_set(), opts).value();
  std::vector<void*> at;
  const bool arena = g.rank == 0 ? f.get("root-layout") == "arena" : g.rank % 3 == 0;
  auto storage = allocate(plan, arena, at);
  std::vector<TensorView> views;
  for (size_t t = 0; t < plan.tensors.size(); ++t) views.push_back(TensorView{plan.tensors[t], at[t], Device::cpu()});

  if (g.rank == 0) {
    for (size_t t = 0; t < plan.tensors.size(); ++t)
      for (uint64_t i = 0; i < plan.nbytes[t]; ++i) static_cast<uint8_t*>(at[t])[i] = pattern(t, i);
    transfer::BucketSender sender(mem.get());
    transfer::BucketSender::Hooks hooks;
    hooks.on_checksum = [&](size_t k, uint64_t sum) { (void)store.set("sum/" + std::to_string(k), std::to_string(sum)); };
    Status s = sender.send(plan, views, *comm.value(), hooks, Clock::now() + g.op_timeout);
    if (!s.ok()) return fail(0, "send failed: " + s.to_string(), 5);
    std::printf("rank 0: sent %zu buckets, staging_peak=%llu\n", plan.buckets.size(),
                static_cast<unsigned long long>(mem->peak()));
    return 0;
  }

  const bool callback = g.rank % 3 == 2;
  std::map<uint32_t, std::vector<uint8_t>> delivered;
  std::vector<const TensorView*> dest(plan.tensors.size(), nullptr);
  if (!callback)
    for (size_t t = 0; t < plan.tensors.size(); ++t) dest[t] = &views[t];
  transfer::FaultInjection faults;
  if (f.has("corrupt-last") && g.rank == 1) faults.corrupt_bucket = static_cast<int64_t>(plan.buckets.size() - 1);
  transfer::BucketReceiver receiver(mem.get(), Device::cpu(), faults);
  transfer::BucketReceiver::Hooks hooks;
  hooks.expected_checksum = [&](size_t k) -> StatusOr<uint64_t> {
    auto v = store.get("sum/" + std::to_string(k), std::chrono::seconds(30));
    if (!v.ok()) return v.status();
    return std::stoull(*v);
  };
  hooks.on_tensor = [&](const TensorView& v) {
    uint32_t t = 0;
    while (plan.tensors[t].name != v.spec.name) ++t;
    const auto* p = static_cast<const uint8_t*>(v.data);
    delivered[t].assign(p, p + plan.nbytes[t]);
    return Status();
  };
  Status s = receiver.receive(plan, dest, *comm.value(), hooks, Clock::now() + g.op_timeout);
  if (!s.ok()) {
    comm.value()->abort(s.message());
    return fail(g.rank, "receive failed: " + s.to_string(), 5);
  }
  for (uint32_t t = 0; t < plan.tensors.size(); ++t) {
    const uint8_t* got = callback ? delivered[t].data() : static_cast<const uint8_t*>(at[t]);
    if (callback && delivered[t].size() != plan.nbytes[t])
      return fail(g.rank, "tensor '" + plan.tensors[t].name + "' delivered " + std::to_string(delivered[t].size()) +
                              " bytes, expected " + std::to_string(plan.nbytes[t]), 1);
    for (uint64_t i = 0; i < plan.nbytes[t]; ++i)
      if (got[i] != pattern(t, i))
        return fail(g.rank, "tensor '" + plan.tensors[t].name + "' byte " + std::to_string(i) + " differs", 1);
  }
  std::printf("rank %d: verified %zu tensors in %zu buckets (%s), staging_peak=%llu\n", g.rank, plan.tensors.size(),
              plan.buckets.size(), callback ? "callback" : arena ? "in place" : "registered",
              static_cast<unsigned long long>(mem->peak()));
  return 0;
}
