#include "common/transfer/bucket_receiver.h"

#include <cstdio>
#include <cstring>
#include <thread>

#include "common/data/bucket_checksum.h"
#include "common/log.h"
#include "common/transfer/issue_ahead.h"
#include "common/transfer/settle.h"
#include "common/transfer/staging_slots.h"

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
  std::vector<delta::Header> headers;  // delta updates: per bucket
  StagingSlots slots;                  // which staging slot each bucket that needs one uses (staging_slots.h)

  bool delta() const { return plan.delta_base != 0; }
  // Bucket k travels as a delta encoding (not dense, not skipped).
  bool encoded(size_t k) const {
    return delta() && (headers[k].kind == delta::Kind::kIndices || headers[k].kind == delta::Kind::kBitmask);
  }

  bool has_dest(uint32_t t) const { return dest[t] != nullptr; }
  // Dense bucket k (not split: whole or packed) has nowhere to land but a
  // staging slot: a packed bucket not in place, or a whole tensor without a
  // destination. (A chunk of a larger tensor without one is assembled.)
  bool staged(size_t k) const {
    const auto& b = plan.buckets[k];
    const uint32_t t0 = b.pieces[0].tensor;
    if (b.direct) return !has_dest(t0) && b.bytes == plan.nbytes[t0];
    return in_place_at[k] == nullptr;
  }
  bool assembled(size_t k) const {
    const auto& b = plan.buckets[k];
    const uint32_t t0 = b.pieces[0].tensor;
    return b.direct && !has_dest(t0) && b.bytes != plan.nbytes[t0];
  }
  // Bucket k's landing: in place when its destinations lie in bucket layout.
  void add(size_t k) {
    const auto& b = plan.buckets[k];
    auto registered = [&](uint32_t t) -> void* { return dest[t] ? dest[t]->data : nullptr; };
    in_place_at.push_back(b.direct ? nullptr : plan.in_place_base(k, registered));
    works.emplace_back();
    where.push_back(nullptr);
    in_place.push_back(false);
    headers.emplace_back();
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
  Update u{plan, destinations, comm, hooks, {}, {}, {}, {}, {}, {}, {}};
  if (u.delta() && !codec_) {
    auto codec = delta::create_codec(mem_, device_);
    if (!codec.ok()) return codec.status();
    codec_ = std::move(*codec);
  }
  uint64_t staging_bytes = 0;
  for (size_t k = 0; k < plan.buckets.size(); ++k) {
    u.add(k);
    const auto& b = plan.buckets[k];
    // Any bucket of a delta update may come encoded, into staging.
    if (u.delta() || u.staged(k)) staging_bytes = std::max(staging_bytes, b.bytes);
  }
  // A streamed plan's buckets are not known yet: stage up to its bucket size.
  if (plan.streamed) staging_bytes = plan.streamed_bucket_bound();
  PC_RETURN_IF_ERROR(staging_.reserve(mem_, staging_bytes));
  using Next = Hooks::Next;
  size_t issued = 0;  // buckets [0, issued) issued
  auto first = have(u, 0, true);
  if (!first.ok()) return settle(u, first.status());
  if (*first == Next::kReady) {
    if (Status s = issue(u, 0); !s.ok()) return settle(u, s);
    issued = 1;
  }
  for (size_t k = 0; k < plan.buckets.size(); ++k) {
    // Bucket k+1 is received while k is verified and unpacked, and the
    // buckets after it that land without a staging slot too, up to
    // kIssueAhead in flight (issue_ahead.h); a streamed one whose layout is
    // not announced yet is waited for after k.
    Next next = Next::kReady;
    Status s;
    while (issued < k + 1 + kIssueAhead) {
      auto n = have(u, issued, false);
      s = n.status();
      if (!s.ok() || *n != Next::kReady) {
        if (s.ok() && issued == k + 1) next = *n;
        break;
      }
      if (issued > k + 1 && !may_issue_ahead(u, issued, k)) break;
      s = issue(u, issued);
      if (!s.ok()) break;
      ++issued;
    }
    if (s.ok()) s = finish(u, k);
    if (s.ok() && issued == k + 1 && next == Next::kNotYet) {
      auto n = have(u, k + 1, true);
      s = n.status();
      if (s.ok() && *n == Next::kReady) {
        s = issue(u, k + 1);
        if (s.ok()) ++issued;
      }
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

// Whether bucket j may be issued while bucket k (< j - 1) is still to be
// finished (issue_ahead.h): not in a delta update, whose buckets' encodings
// are announced one by one; yes when it lands where the engine reads it;
// and a staged one once the bucket that used its slot before (staging_slots.h)
// was finished (buckets before k are).
bool BucketReceiver::may_issue_ahead(const Update& u, size_t j, size_t k) const {
  if (u.delta()) return false;
  if (u.assembled(j)) return false;  // assembled: in order
  if (!u.staged(j)) return true;
  const auto blocker = u.slots.blocker();
  return !blocker || *blocker < k;
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
  if (!settle_works(u.works, *mem_, deadline_)) {
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
  if (u.delta()) {
    if (!u.hooks.delta_header) return internal_error("a delta update but no source of bucket encodings");
    auto h = u.hooks.delta_header(k);
    if (!h.ok()) return h.status();
    PC_RETURN_IF_ERROR(delta::check_header(*h, b.bytes, b.pieces.size(), u.bucket_name(k)));
    // Before a byte lands: the pieces' hashes must be of the kind this
    // engine's memory checks.
    if (h->piece_hash != codec_->piece_hash())
      return data_corrupt("delta header of " + u.bucket_name(k) + ": piece hashes of kind " +
                          checksum_name(h->piece_hash) + ", this engine's memory checks " +
                          checksum_name(codec_->piece_hash()) + "; nothing was written");
    if (h->unit != u.plan.bucket_unit(k) || h->wire_bytes > b.bytes)
      return data_corrupt("delta header of " + u.bucket_name(k) + ": unit " + std::to_string(h->unit) + " and " +
                          std::to_string(h->wire_bytes) + " wire bytes do not fit a bucket of " +
                          std::to_string(b.bytes) + " bytes in units of " + std::to_string(u.plan.bucket_unit(k)));
    u.headers[k] = std::move(*h);
    if (u.headers[k].kind == delta::Kind::kUnchanged) return Status();  // nothing is broadcast
    if (u.encoded(k)) {
      // Issued only once bucket k-1 is on its way and the buckets before it
      // finished: the slot's previous user (two staged buckets back) is done.
      u.where[k] = staging_.slot(u.slots.take(k));
      if (mem_->stream()) PC_RETURN_IF_ERROR(u.comm.order_after(mem_->stream()));
      u.works[k] = u.comm.broadcast(u.where[k], u.headers[k].wire_bytes, 0);
      return Status();
    }
  }
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
    u.where[k] = staging_.slot(u.slots.take(k));
    // The slot's previous bucket may still be unpacking on the copy stream.
    if (mem_->stream()) PC_RETURN_IF_ERROR(u.comm.order_after(mem_->stream()));
  }
  u.works[k] = u.comm.broadcast(u.where[k], b.bytes, 0);
  return Status();
}

Status BucketReceiver::finish(Update& u, size_t k) {
  const auto& b = u.plan.buckets[k];
  if (u.works[k]) {  // none: an unchanged bucket of a delta update
    Status landed = u.works[k]->wait(deadline_);
    u.works[k].reset();
    PC_RETURN_IF_ERROR(landed.with_context(u.bucket_name(k)));
  }
  received_ += b.bytes;
  if (u.delta() && u.headers[k].kind == delta::Kind::kUnchanged) {
    PC_RETURN_IF_ERROR(check_pieces(u, k));
    return deliver(u, k);
  }
  if (faults_.corrupts(u.plan.version, k) && b.bytes > 0 && u.where[k]) {
    faults_.corrupt_bucket = -1;  // once
    uint8_t byte;
    PC_RETURN_IF_ERROR(mem_->copy(&byte, u.where[k], 1));
    byte ^= 0x01;
    PC_RETURN_IF_ERROR(mem_->copy(u.where[k], &byte, 1));
  }
  if (u.encoded(k)) return land_delta(u, k);
  if (u.plan.checksum != Checksum::kNone && !u.delta()) PC_RETURN_IF_ERROR(verify(u, k));
  std::vector<DeviceMemory::CopyOp> unpack;
  if (!b.direct && !u.in_place[k])
    for (const auto& p : b.pieces)
      if (u.has_dest(p.tensor))
        unpack.push_back({static_cast<uint8_t*>(u.dest[p.tensor]->data) + p.tensor_offset, u.where[k] + p.bucket_offset,
                          p.length});
  // Tensors kept between updates (an engine's copy for its callback) take
  // the new bytes too, so that the next delta applies onto this version.
  for (const auto& p : b.pieces)
    if (uint8_t* copy = kept(u, p.tensor)) unpack.push_back({copy + p.tensor_offset, u.where[k] + p.bucket_offset, p.length});
  PC_RETURN_IF_ERROR(mem_->copy_many(unpack));
  if (u.delta()) PC_RETURN_IF_ERROR(check_pieces(u, k));
  return deliver(u, k);
}

uint8_t* BucketReceiver::kept(Update& u, uint32_t t) {
  return !u.has_dest(t) && u.hooks.copy_of ? u.hooks.copy_of(t) : nullptr;
}

// A delta: applied (on the device for CUDA memory) onto the destinations, which hold the
// baseline version, or onto the engine's copy of it.
Status BucketReceiver::land_delta(Update& u, size_t k) {
  const auto& b = u.plan.buckets[k];
  std::vector<delta::Segment> segments;
  segments.reserve(b.pieces.size());
  for (const auto& p : b.pieces) {
    if (p.length == 0) {  // an empty tensor may have no buffer at all: nothing lands there
      segments.push_back({nullptr, nullptr, p.bucket_offset, 0});
      continue;
    }
    uint8_t* at = u.has_dest(p.tensor) ? static_cast<uint8_t*>(u.dest[p.tensor]->data) : kept(u, p.tensor);
    if (!at)
      return internal_error("delta of " + u.bucket_name(k) + ": tensor '" + u.plan.tensors[p.tensor].name +
                            "' has neither a destination nor a kept copy to apply it to");
    segments.push_back({nullptr, at + p.tensor_offset, p.bucket_offset, p.length});
  }
  PC_RETURN_IF_ERROR(codec_->apply(u.headers[k], u.where[k], b.bytes, segments, u.bucket_name(k)));
  PC_RETURN_IF_ERROR(check_pieces(u, k));
  return deliver(u, k);
}

// Every piece's resulting bytes against the publisher's hash of the new
// version: a delta update is verified end to end, naming the tensor.
Status BucketReceiver::check_pieces(Update& u, size_t k) {
  const auto& b = u.plan.buckets[k];
  const auto& h = u.headers[k];  // its hash kind checked when it arrived (issue)
  std::vector<delta::DeltaCodec::Piece> pieces;
  pieces.reserve(b.pieces.size());
  for (const auto& p : b.pieces) {
    if (p.length == 0) {  // an empty tensor may have no buffer at all: its hash is that of no bytes
      pieces.push_back({nullptr, 0});
      continue;
    }
    const uint8_t* at = u.has_dest(p.tensor) ? static_cast<const uint8_t*>(u.dest[p.tensor]->data) : kept(u, p.tensor);
    if (!at) {
      // Handed to on_tensor from where it landed: only a dense bucket can be.
      if (u.encoded(k) || h.kind == delta::Kind::kUnchanged)
        return internal_error("delta of " + u.bucket_name(k) + ": tensor '" + u.plan.tensors[p.tensor].name +
                              "' has nowhere to keep it");
      at = u.where[k] + p.bucket_offset - p.tensor_offset;
    }
    pieces.push_back({at + p.tensor_offset, p.length});
  }
  PC_RETURN_IF_ERROR(mem_->synchronize());  // unpacks queued on the copy stream land first
  auto got = codec_->hash_pieces(pieces);
  if (!got.ok()) return got.status().with_context("hashing the pieces of " + u.bucket_name(k));
  for (size_t i = 0; i < b.pieces.size(); ++i) {
    const auto& p = b.pieces[i];
    if ((*got)[i] == h.piece_hashes[i]) continue;
    char buf[64];
    std::snprintf(buf, sizeof buf, "expected %016llx, got %016llx", static_cast<unsigned long long>(h.piece_hashes[i]),
                  static_cast<unsigned long long>((*got)[i]));
    return data_corrupt("tensor '" + u.plan.tensors[p.tensor].name + "' (bytes " + std::to_string(p.tensor_offset) +
                        ".." + std::to_string(p.tensor_offset + p.length) + ") differs from the publisher's v" +
                        std::to_string(u.plan.version) + " after " + delta::kind_name(h.kind) + " " +
                        u.bucket_name(k) + ": " + buf + "; the engine holds the bad bytes");
  }
  return Status();
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
    if (uint8_t* copy = kept(u, p.tensor)) view.data = copy;  // the whole tensor, as kept
    else view.data = a != u.assembly.end() ? a->second.data() : u.where[k] + p.bucket_offset;
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
  uint64_t largest = plan.streamed ? plan.streamed_bucket_bound() : 0;
  for (const auto& b : plan.buckets) largest = std::max(largest, b.bytes);
  PC_RETURN_IF_ERROR(staging_.reserve(mem_, largest));
  std::vector<const TensorView*> none(plan.tensors.size(), nullptr);
  Update u{plan, none, comm, hooks, {}, {}, {}, {}, {}, {}, {}};
  for (size_t k = 0;; ++k) {
    auto next = have(u, k, true);
    if (!next.ok()) return next.status();
    if (*next != Hooks::Next::kReady) break;
    uint64_t bytes = plan.buckets[k].bytes;
    if (u.delta()) {  // the encoding's size, as announced
      if (!hooks.delta_header) return internal_error("a delta update but no source of bucket encodings");
      auto h = hooks.delta_header(k);
      if (!h.ok()) return h.status();
      PC_RETURN_IF_ERROR(delta::check_header(*h, bytes, plan.buckets[k].pieces.size(), "dropped bucket " +
                                                                                       std::to_string(k)));
      if (h->wire_bytes > bytes) return data_corrupt("dropped bucket " + std::to_string(k) + ": a delta larger than it");
      bytes = h->wire_bytes;
      if (bytes == 0) continue;
    }
    // One broadcast at a time, each waited for: one slot serves them all.
    PC_RETURN_IF_ERROR(comm.broadcast(staging_.slot(0), bytes, 0)
                           ->wait(deadline)
                           .with_context("dropped bucket " + std::to_string(k) + " of v" + std::to_string(plan.version)));
    received_ += plan.buckets[k].bytes;
  }
  return Status();
}

}  // namespace paramcast::transfer
