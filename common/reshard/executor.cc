#include "common/reshard/executor.h"

#include "common/xxhash.h"

#include <cstdio>
#include <cstring>
#include <map>
#include <optional>

namespace paramcast::reshard {
namespace {

// Row-major strides (in elements) of a buffer holding `box`.
std::vector<uint64_t> strides(const Region& box) {
  std::vector<uint64_t> s(box.rank(), 1);
  for (size_t d = box.rank(); d-- > 1;) s[d - 1] = s[d] * static_cast<uint64_t>(box.lengths[d]);
  return s;
}

// Element offset of `at` (global indices) in a buffer holding `box`.
uint64_t offset_of(const Region& box, const std::vector<uint64_t>& stride, const std::vector<int64_t>& at) {
  uint64_t o = 0;
  for (size_t d = 0; d < box.rank(); ++d) o += static_cast<uint64_t>(at[d] - box.offsets[d]) * stride[d];
  return o;
}

// Byte offset of `region` in a buffer holding `box` when its elements lie
// there back to back (every dimension after its first longer than one is
// whole in the box), else nullopt.
std::optional<uint64_t> contiguous_at(const Region& box, const Region& region, size_t element) {
  size_t d = 0;
  while (d < region.rank() && region.lengths[d] == 1) ++d;
  for (size_t e = d + 1; e < region.rank(); ++e)
    if (region.offsets[e] != box.offsets[e] || region.lengths[e] != box.lengths[e]) return std::nullopt;
  return offset_of(box, strides(box), region.offsets) * element;
}

}  // namespace

void copy_region(const uint8_t* src, const Region& from, uint8_t* dst, const Region& to, const Region& region,
                 size_t element) {
  if (region.empty()) return;
  if (region.rank() == 0) {
    std::memcpy(dst, src, element);
    return;
  }
  const auto sf = strides(from), st = strides(to);
  const size_t last = region.rank() - 1;
  const size_t run = static_cast<size_t>(region.lengths[last]) * element;
  std::vector<int64_t> at = region.offsets;  // the first element of the current run
  for (;;) {
    std::memcpy(dst + offset_of(to, st, at) * element, src + offset_of(from, sf, at) * element, run);
    // Next run: count up the dimensions before the last, like an odometer.
    size_t d = last;
    for (;;) {
      if (d == 0) return;
      --d;
      if (++at[d] < region.offsets[d] + region.lengths[d]) break;
      at[d] = region.offsets[d];
    }
  }
}

Status run_reshard(const ReshardPlan& plan, const std::vector<Round>& rounds, int rank, Communicator& comm,
                   const RankBuffers& buffers, Deadline deadline, const RunOptions& options) {
  if (plan.transfers.size() >= kChecksumTag)
    return invalid_argument("many-sender plan: " + std::to_string(plan.transfers.size()) +
                            " transfers, more than a tag can number");
  struct Posted {
    size_t transfer = 0;
    std::shared_ptr<Work> work;
    std::shared_ptr<Work> sum_work;  // the checksum that follows it (RunOptions::checksums)
    std::shared_ptr<uint64_t> sum = std::make_shared<uint64_t>(0);  // sent, or received
    const uint8_t* bytes = nullptr;  // where the transfer's bytes are, contiguous (a receive: once landed)
    std::vector<uint8_t> staging;  // packed bytes (a send) or their landing (a receive) when not contiguous
    LocalBuffer at;                // this rank's buffer the region is in
    bool direct = false;
  };
  // This rank's transfers, in schedule order.
  std::vector<Posted> sends, recvs;
  for (const auto& round : rounds)
    for (size_t i : round.transfers) {
      const Transfer& x = plan.transfers[i];
      if (x.from != rank && x.to != rank) continue;
      Posted p;
      p.transfer = i;
      p.at = buffers.find(plan.tensors[x.tensor], x.region);
      if (!p.at.data || intersect(p.at.box, x.region) != x.region)
        return internal_error("many-sender plan: rank " + std::to_string(rank) + " has no buffer for '" +
                              plan.tensors[x.tensor].name + "' " + x.region.to_string());
      (x.from == rank ? sends : recvs).push_back(std::move(p));
    }
  std::vector<Posted*> all;
  for (auto& p : sends) all.push_back(&p);
  for (auto& p : recvs) all.push_back(&p);
  auto element = [&](const Transfer& x) { return dtype_size(plan.tensors[x.tensor].dtype); };
  auto post_send = [&](Posted& p) {
    const Transfer& x = plan.transfers[p.transfer];
    const auto at = contiguous_at(p.at.box, x.region, element(x));
    const uint8_t* from = at ? p.at.data + *at : nullptr;
    if (!at) {
      p.staging.resize(x.bytes);
      copy_region(p.at.data, p.at.box, p.staging.data(), x.region, x.region, element(x));
      from = p.staging.data();
    }
    p.work = comm.send(from, x.bytes, x.to, static_cast<uint32_t>(p.transfer));
    if (options.checksums) {
      *p.sum = xxh64(from, x.bytes);
      p.sum_work = comm.send(p.sum.get(), sizeof(uint64_t), x.to, static_cast<uint32_t>(p.transfer) | kChecksumTag);
    }
  };
  // A failure: abort, and let every posted Work settle (an aborted
  // communicator completes them once no I/O is left on them) before the
  // staging goes; staging whose Work does not settle is let go, never
  // freed under a write.
  auto fail = [&](const Posted& p, Status s) {
    comm.abort(s.message());
    for (Posted* q : all) {
      if (!q->work) continue;
      Status settled = q->work->wait(Clock::now() + kSettleTimeout);
      if (settled.code() == Code::kTimeout || !q->work->settled()) {
        if (q->direct && options.unsettled) *options.unsettled = true;
        new std::vector<uint8_t>(std::move(q->staging));  // deliberately leaked
      }
      if (q->sum_work && (q->sum_work->wait(Clock::now() + kSettleTimeout).code() == Code::kTimeout ||
                          !q->sum_work->settled()))
        new std::shared_ptr<uint64_t>(q->sum);  // deliberately leaked
    }
    const Transfer& x = plan.transfers[p.transfer];
    return s.with_context("many-sender plan: '" + plan.tensors[x.tensor].name + "' " + x.region.to_string() +
                          " from rank " + std::to_string(x.from) + " to rank " + std::to_string(x.to));
  };
  // Every receive is posted at once, in schedule order, into its place (or
  // staging); every send that needs no receive first, too: each link then
  // carries its bytes back to back, with no barrier between rounds. A
  // forward goes out once the receive that brings its bytes landed.
  for (auto& p : recvs) {
    const Transfer& x = plan.transfers[p.transfer];
    const auto at = contiguous_at(p.at.box, x.region, element(x));
    p.direct = at.has_value();
    uint8_t* into = at ? p.at.data + *at : nullptr;
    if (!at) {
      p.staging.resize(x.bytes);
      into = p.staging.data();
    }
    p.work = comm.recv(into, x.bytes, x.from, static_cast<uint32_t>(p.transfer));
    p.bytes = into;
    if (options.checksums)
      p.sum_work = comm.recv(p.sum.get(), sizeof(uint64_t), x.from, static_cast<uint32_t>(p.transfer) | kChecksumTag);
  }
  std::map<size_t, std::vector<Posted*>> forwards;  // by the transfer that brings their bytes
  for (auto& p : sends) {
    const Transfer& x = plan.transfers[p.transfer];
    if (x.after >= 0) forwards[static_cast<size_t>(x.after)].push_back(&p);
    else post_send(p);
  }
  for (auto& p : recvs) {
    const Transfer& x = plan.transfers[p.transfer];
    if (Status s = p.work->wait(deadline); !s.ok()) return fail(p, s);
    if (p.sum_work) {
      if (Status s = p.sum_work->wait(deadline); !s.ok()) return fail(p, s);
      const uint64_t got = xxh64(p.bytes, x.bytes);
      if (got != *p.sum) {
        char text[64];
        std::snprintf(text, sizeof text, "xxh64 %016llx, the sender's %016llx", static_cast<unsigned long long>(got),
                      static_cast<unsigned long long>(*p.sum));
        return fail(p, data_corrupt(std::to_string(x.bytes) + " bytes arrived with " + text));
      }
    }
    if (options.received) *options.received += x.bytes;
    if (!p.direct) copy_region(p.staging.data(), x.region, p.at.data, p.at.box, x.region, element(x));
    for (Posted* f : forwards[p.transfer]) post_send(*f);
  }
  for (auto& p : sends) {
    if (Status s = p.work ? p.work->wait(deadline) : internal_error("a forward whose bytes never came"); !s.ok())
      return fail(p, s);
    if (p.sum_work)
      if (Status s = p.sum_work->wait(deadline); !s.ok()) return fail(p, s);
  }
  return Status();
}

}  // namespace paramcast::reshard
