#include "common/reshard/executor.h"

#include <cstring>
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
                   const RankBuffers& buffers, Deadline deadline) {
  for (size_t r = 0; r < rounds.size(); ++r) {
    struct Posted {
      size_t transfer;
      std::shared_ptr<Work> work;
      std::vector<uint8_t> staging;  // packed bytes (a send) or their landing (a receive) when not contiguous
      LocalBuffer into;              // a receive to unpack
    };
    std::vector<Posted> posted;
    posted.reserve(2);
    for (size_t i : rounds[r].transfers) {
      const Transfer& x = plan.transfers[i];
      if (x.from != rank && x.to != rank) continue;
      const bool sending = x.from == rank;
      const size_t element = dtype_size(plan.tensors[x.tensor].dtype);
      LocalBuffer at = buffers.find(x.tensor, x.region);
      const std::string what = std::string(sending ? "sending" : "receiving") + " '" + plan.tensors[x.tensor].name +
                               "' " + x.region.to_string() + (sending ? " to rank " : " from rank ") +
                               std::to_string(sending ? x.to : x.from);
      if (!at.data || !intersect(at.box, x.region) || *intersect(at.box, x.region) != x.region)
        return internal_error("many-sender plan: rank " + std::to_string(rank) + " has no buffer for " + what);
      Posted p{i, nullptr, {}, {}};
      const auto direct = contiguous_at(at.box, x.region, element);
      const auto tag = static_cast<uint32_t>(i);
      if (sending) {
        const uint8_t* from = direct ? at.data + *direct : nullptr;
        if (!direct) {
          p.staging.resize(x.bytes);
          copy_region(at.data, at.box, p.staging.data(), x.region, x.region, element);
          from = p.staging.data();
        }
        p.work = comm.send(from, x.bytes, x.to, tag);
      } else {
        uint8_t* into = direct ? at.data + *direct : nullptr;
        if (!direct) {
          p.staging.resize(x.bytes);
          p.into = at;
          into = p.staging.data();
        }
        p.work = comm.recv(into, x.bytes, x.from, tag);
      }
      posted.push_back(std::move(p));
    }
    for (auto& p : posted) {
      const Transfer& x = plan.transfers[p.transfer];
      Status s = p.work->wait(deadline);
      if (!s.ok()) {
        // The others may still touch their memory: abort, and let each
        // settle (an aborted communicator completes its Works once no I/O
        // is left on them) before this frame's staging goes; staging whose
        // Work does not settle is let go, never freed under a write.
        comm.abort(s.message());
        for (auto& q : posted) {
          Status settled = q.work->wait(Clock::now() + kSettleTimeout);
          if (settled.code() == Code::kTimeout || !q.work->settled())
            new std::vector<uint8_t>(std::move(q.staging));  // deliberately leaked
        }
        return s.with_context("many-sender plan, round " + std::to_string(r) + ": '" + plan.tensors[x.tensor].name +
                              "' " + x.region.to_string() + " from rank " + std::to_string(x.from) + " to rank " +
                              std::to_string(x.to));
      }
      if (p.into.data)
        copy_region(p.staging.data(), x.region, p.into.data, p.into.box, x.region,
                    dtype_size(plan.tensors[x.tensor].dtype));
    }
  }
  return Status();
}

}  // namespace paramcast::reshard
