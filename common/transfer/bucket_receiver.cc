#include "common/transfer/bucket_receiver.h"

#include <cstdio>
#include <thread>

#include "common/log.h"

namespace paramcast::transfer {

struct BucketReceiver::Update {
  UpdatePlan& plan;
  const std::vector<const TensorView*>& dest;
  Communicator& comm;
  const Hooks& hooks;
  std::vector<uint8_t*> in_place_at;
  std::map<uint32_t, StagingBuffer> assembly;  // large tensors without a destination, by tensor index
  std::vector<std::shared_ptr<Work>> works;
  std::vector<uint8_t*> where;
  std::vector<bool> in_place;

  bool has_dest(uint32_t t) const { return dest[t] != nullptr; }
  // Bucket k's landing: in place when its destinations lie in bucket layout.
  void add(size_t k) {
    const auto& b = plan.buckets[k];
    auto registered = [&](uint32_t t) -> void* { return dest[t] ? dest[t]->data : nullptr; };
    in_place_at.push_back(b.direct ? nullptr : plan.in_place_base(k, registered));
    works.emplace_back();
    where.push_back(nullptr);
    in_place.push_back(false);
  }
  std::string bucket_name(size_t k) const { return "bucket " + std::to_string(k) + " of v" + std::to_string(plan.version); }
};

BucketReceiver::BucketReceiver(DeviceMemory* memory, Device device, FaultInjection faults)
    : mem_(memory), device_(device), faults_(faults) {}

Status BucketReceiver::receive(UpdatePlan& plan, const std::vector<const TensorView*>& destinations,
                               Communicator& comm, const Hooks& hooks, Deadline deadline) {
  deadline_ = deadline;
  received_ = 0;
  PC_CHECK_EQ(destinations.size(), plan.tensors.size());
  Update u{plan, destinations, comm, hooks, {}, {}, {}, {}, {}};
  uint64_t staging_bytes = 0;
  for (size_t k = 0; k < plan.buckets.size(); ++k) {
    u.add(k);
    const auto& b = plan.buckets[k];
    const uint32_t t0 = b.pieces[0].tensor;
    const bool staged = b.direct ? !u.has_dest(t0) && b.bytes == plan.nbytes[t0] : u.in_place_at[k] == nullptr;
    if (staged) staging_bytes = std::max(staging_bytes, b.bytes);
  }
  // A streamed plan's buckets are not known yet: stage up to its bucket size.
  if (plan.streamed) staging_bytes = std::min(plan.bucket_bytes, plan.total_bytes);
  PC_RETURN_IF_ERROR(staging_.reserve(mem_, staging_bytes));
  using Next = Hooks::Next;
  auto first = have(u, 0, true);
  if (!first.ok()) return settle(u, first.status());
  if (*first == Next::kReady) {
    if (Status s = issue(u, 0); !s.ok()) return settle(u, s);
  }
  for (size_t k = 0; k < plan.buckets.size(); ++k) {
    // Bucket k+1 is received while k is verified and unpacked; a streamed
    // one whose layout is not announced yet is waited for after k.
    auto next = have(u, k + 1, false);
    Status s = next.status();
    if (s.ok() && *next == Next::kReady) s = issue(u, k + 1);
    if (s.ok()) s = finish(u, k);
    if (s.ok() && *next == Next::kNotYet) {
      next = have(u, k + 1, true);
      s = next.status();
      if (s.ok() && *next == Next::kReady) s = issue(u, k + 1);
    }
    if (!s.ok()) return settle(u, s);
    if (faults_.stalls_after(plan.version, k)) {
      PC_WARN("subscriber: fault injection: stalling after bucket " << k << " of v" << plan.version);
      while (!stopping_) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return settle(u, aborted("subscriber stopped mid-update (fault injection)"));
    }
  }
  // Unpacks are queued on the copy stream: the registered destinations are
  // complete when receive() returns (before on_update_end and Applied).
  Status s = mem_->synchronize();
  return s.ok() ? s : settle(u, s.with_context("unpacking v" + std::to_string(plan.version)));
}

// Whether bucket k exists: listed in the plan, or (streamed) announced,
// checked and appended now; kEnded once the stream ended complete.
StatusOr<BucketReceiver::Hooks::Next> BucketReceiver::have(Update& u, size_t k, bool wait) {
  using Next = Hooks::Next;
  if (k < u.plan.buckets.size()) return Next::kReady;
  if (!u.plan.streamed) return Next::kEnded;
  if (!u.hooks.next_bucket) return internal_error("a streamed plan but no source of bucket layouts");
  PlanBucket b;
  auto next = u.hooks.next_bucket(k, wait, b);
  if (!next.ok()) return next.status();
  if (*next == Next::kEnded) {
    PC_RETURN_IF_ERROR(u.plan.end_stream());
    return next;
  }
  if (*next == Next::kReady) {
    PC_RETURN_IF_ERROR(u.plan.add_streamed_bucket(std::move(b)));
    u.add(k);
  }
  return next;
}

// A failed receive waits out every issued broadcast (at most one bucket
// ahead; the root sends it regardless) before the staging and assembly
// buffers may be reused: a deadline aborts the communicator, and a Work of an
// aborted communicator waits for the abort to finish. If that cannot be
// confirmed, the buffers are let go instead. The caller then abandons the
// communicator (the collective is half-done).
Status BucketReceiver::settle(Update& u, Status failure) {
  bool quiet = true;
  for (auto& w : u.works) {
    if (!w) continue;
    (void)w->wait(std::max(deadline_, Clock::now() + kSettleTimeout));
    if (!w->settled()) quiet = false;
    w.reset();
  }
  if (!mem_->synchronize().ok()) quiet = false;
  if (!quiet) {
    PC_WARN("subscriber: in-flight work did not settle after a failure; its buffers are let go, not reused");
    staging_.abandon();
    for (auto& [t, buf] : u.assembly) buf.abandon();
  }
  return failure;
}

// Chooses where bucket k lands and issues its broadcast.
Status BucketReceiver::issue(Update& u, size_t k) {
  const auto& b = u.plan.buckets[k];
  const auto& p0 = b.pieces[0];
  if (b.direct && u.has_dest(p0.tensor)) {
    u.where[k] = static_cast<uint8_t*>(u.dest[p0.tensor]->data) + p0.tensor_offset;
  } else if (b.direct && b.bytes != u.plan.nbytes[p0.tensor]) {
    auto& buf = u.assembly[p0.tensor];
    if (!buf.data()) {
      auto p = mem_->allocate(u.plan.nbytes[p0.tensor]);
      if (!p.ok()) return p.status();
      buf = StagingBuffer(mem_, *p, u.plan.nbytes[p0.tensor]);
    }
    u.where[k] = buf.data() + p0.tensor_offset;
  } else if (uint8_t* base = u.in_place_at[k]) {
    u.where[k] = base;  // the destinations lie in bucket layout: no staging, no unpack
    u.in_place[k] = true;
  } else {
    u.where[k] = staging_.slot(k);
    // The slot's previous bucket may still be unpacking on the copy stream.
    if (mem_->stream()) PC_RETURN_IF_ERROR(u.comm.order_after(mem_->stream()));
  }
  u.works[k] = u.comm.broadcast(u.where[k], b.bytes, 0);
  return Status();
}

Status BucketReceiver::finish(Update& u, size_t k) {
  const auto& b = u.plan.buckets[k];
  Status landed = u.works[k]->wait(deadline_);
  u.works[k].reset();
  PC_RETURN_IF_ERROR(landed.with_context(u.bucket_name(k)));
  received_ += b.bytes;
  if (faults_.corrupt_bucket == static_cast<int64_t>(k) && b.bytes > 0) {
    faults_.corrupt_bucket = -1;  // once
    uint8_t byte;
    PC_RETURN_IF_ERROR(mem_->copy(&byte, u.where[k], 1));
    byte ^= 0x01;
    PC_RETURN_IF_ERROR(mem_->copy(u.where[k], &byte, 1));
  }
  if (u.plan.checksum != Checksum::kNone) PC_RETURN_IF_ERROR(verify(u, k));
  std::vector<DeviceMemory::CopyOp> unpack;
  if (!b.direct && !u.in_place[k])
    for (const auto& p : b.pieces)
      if (u.has_dest(p.tensor))
        unpack.push_back({static_cast<uint8_t*>(u.dest[p.tensor]->data) + p.tensor_offset, u.where[k] + p.bucket_offset,
                          p.length});
  PC_RETURN_IF_ERROR(mem_->copy_many(unpack));
  return deliver(u, k);
}

Status BucketReceiver::verify(Update& u, size_t k) {
  const auto& b = u.plan.buckets[k];
  auto got = mem_->checksum(u.where[k], b.bytes, u.plan.checksum);
  if (!got.ok()) return got.status();
  if (!u.hooks.expected_checksum) return internal_error("checksums are on but no source of expected checksums");
  auto expected = u.hooks.expected_checksum(k);
  if (!expected.ok()) return expected.status();
  if (*got == *expected) return Status();
  char buf[64];
  std::snprintf(buf, sizeof buf, "expected %016llx, got %016llx", static_cast<unsigned long long>(*expected),
                static_cast<unsigned long long>(*got));
  const bool written = u.in_place[k] || (b.direct && u.has_dest(b.pieces[0].tensor));
  return data_corrupt("checksum mismatch in " + u.bucket_name(k) + " (tensors " + u.plan.bucket_tensor_names(k) +
                      "): " + buf + (written ? "; the destinations hold the bad bytes" : "; nothing was unpacked"));
}

// Hands every tensor of bucket k that has no destination and is now complete to on_tensor.
Status BucketReceiver::deliver(Update& u, size_t k) {
  for (const auto& p : u.plan.buckets[k].pieces) {
    if (u.has_dest(p.tensor)) continue;
    if (p.tensor_offset + p.length != u.plan.nbytes[p.tensor]) continue;  // tensor not complete yet
    const auto& spec = u.plan.tensors[p.tensor];
    TensorView view;
    view.spec = spec;
    view.device = device_;
    auto a = u.assembly.find(p.tensor);
    view.data = a != u.assembly.end() ? a->second.data() : u.where[k] + p.bucket_offset;
    if (u.hooks.on_tensor) {
      Status cs = u.hooks.on_tensor(view);
      if (!cs.ok()) return cs.with_context("tensor callback for '" + spec.name + "'");
    }
    if (a != u.assembly.end()) u.assembly.erase(a);
  }
  return Status();
}

Status BucketReceiver::drop(UpdatePlan& plan, Communicator& comm, const Hooks& hooks, Deadline deadline) {
  received_ = 0;
  deadline_ = deadline;
  uint64_t largest = plan.streamed ? std::min(plan.bucket_bytes, plan.total_bytes) : 0;
  for (const auto& b : plan.buckets) largest = std::max(largest, b.bytes);
  PC_RETURN_IF_ERROR(staging_.reserve(mem_, largest));
  std::vector<const TensorView*> none(plan.tensors.size(), nullptr);
  Update u{plan, none, comm, hooks, {}, {}, {}, {}, {}};
  for (size_t k = 0;; ++k) {
    auto next = have(u, k, true);
    if (!next.ok()) return next.status();
    if (*next != Hooks::Next::kReady) break;
    PC_RETURN_IF_ERROR(comm.broadcast(staging_.slot(k), plan.buckets[k].bytes, 0)
                           ->wait(deadline)
                           .with_context("dropped bucket " + std::to_string(k) + " of v" + std::to_string(plan.version)));
    received_ += plan.buckets[k].bytes;
  }
  return Status();
}

}  // namespace paramcast::transfer
