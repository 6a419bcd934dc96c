#include "common/reshard/rank_plan.h"

#include <algorithm>
#include <tuple>

namespace paramcast::reshard {
namespace {

// One side of a tensor (its holders or its wanters) as the planner reads it.
struct Side {
  const Placement* p = nullptr;
  int parts = 1;     // rule: ranks per copy; explicit: boxes
  int replicas = 1;  // rule: copies; explicit: 1
  std::vector<Segment> segments;

  Side(const JobLayout& job, uint32_t placement, const std::vector<int64_t>& shape)
      : p(&job.placements[placement]) {
    if (p->is_explicit()) {
      parts = static_cast<int>(p->boxes.size());
      segments = {Segment{0, 0}};
      return;
    }
    const Mesh& m = job.meshes[p->mesh];
    parts = m.parts;
    replicas = m.replicas;
    segments = segments_of(*p, shape);
  }
  int rank(const JobLayout& job, int replica, uint32_t part) const {
    if (p->is_explicit()) return p->boxes[part].rank;
    return job.meshes[p->mesh].ranks[static_cast<size_t>(replica) * static_cast<size_t>(parts) + part];
  }
  Region box(const std::vector<int64_t>& shape, uint16_t segment, uint32_t part) const {
    if (p->is_explicit()) return p->boxes[part].box;
    return part_box(*p, shape, segments[segment], parts, static_cast<int>(part));
  }
};

// [lo, hi) of part j of a rule side along `dim` (the whole dim elsewhere).
std::pair<int64_t, int64_t> span(const Side& s, size_t dim, int64_t extent, uint16_t segment, uint32_t part) {
  if (static_cast<size_t>(s.p->dim) != dim) return {0, extent};
  const Segment c = chunk_of(s.segments[segment], s.parts, static_cast<int>(part));
  return {c.start, c.start + c.size};
}

// Elements where the holder's part meets the wanter's: arithmetic for two
// rules (no allocation: this runs once per piece), boxes otherwise.
uint64_t meet(const std::vector<int64_t>& shape, const Side& h, uint16_t sh, uint32_t jh, const Side& w, uint16_t sw,
              uint32_t jw) {
  if (h.p->is_explicit() || w.p->is_explicit()) {
    auto common = intersect(h.box(shape, sh, jh), w.box(shape, sw, jw));
    return common ? common->elements() : 0;
  }
  uint64_t n = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    auto [hl, hh] = span(h, d, shape[d], sh, jh);
    auto [wl, wh] = span(w, d, shape[d], sw, jw);
    const int64_t lo = std::max(hl, wl), hi = std::min(hh, wh);
    if (hi <= lo) return 0;
    n *= static_cast<uint64_t>(hi - lo);
  }
  return n;
}

// Calls fn(segment, part) for every part of `other` that can meet `box`
// (the rule's part range along its dim, per segment; every box if explicit).
template <typename Fn>
void each_meeting_part(const Side& other, const std::vector<int64_t>& shape, const Region& box, Fn&& fn) {
  if (other.p->is_explicit()) {
    for (uint32_t j = 0; j < static_cast<uint32_t>(other.parts); ++j) fn(uint16_t{0}, j);
    return;
  }
  const auto d = static_cast<size_t>(other.p->dim);
  const int64_t lo = d < shape.size() ? box.offsets[d] : 0, hi = d < shape.size() ? lo + box.lengths[d] : 1;
  for (size_t s = 0; s < other.segments.size(); ++s) {
    const Segment& seg = other.segments[s];
    const int64_t a = std::max(lo, seg.start), b = std::min(hi, seg.start + seg.size);
    if (b <= a) continue;
    const int64_t chunk = (seg.size + other.parts - 1) / other.parts;
    const int64_t last = std::min<int64_t>(other.parts - 1, (b - 1 - seg.start) / chunk);
    for (int64_t j = (a - seg.start) / chunk; j <= last; ++j) fn(static_cast<uint16_t>(s), static_cast<uint32_t>(j));
  }
}

class Planner {
 public:
  static int sending_replica(uint32_t t, uint16_t sw, uint32_t jw, int replicas) {
    return static_cast<int>((uint64_t{t} + sw + jw) % static_cast<uint64_t>(replicas));
  }

  Planner(const JobLayout& job, int rank) : job_(job) {
    out_.rank = rank;
    at_.assign(job.meshes.size(), -1);
    for (size_t m = 0; m < job.meshes.size(); ++m) {
      const auto& ranks = job.meshes[m].ranks;
      auto it = std::find(ranks.begin(), ranks.end(), rank);
      if (it != ranks.end()) at_[m] = static_cast<int>(it - ranks.begin());
    }
  }

  // Two passes: the first counts, so that the lists are allocated once, at
  // their size (a vector's doubling would hold 3x the moves at its peak).
  RankPlan run() {
    counting_ = true;
    walk();
    out_.sends.reserve(sends_);
    out_.receives.reserve(receives_);
    out_.bytes_in = out_.bytes_out = 0;
    counting_ = false;
    walk();
    auto order = [](const Move& a, const Move& b) {
      return std::tie(a.peer, a.depth, a.tensor, a.held_segment, a.want_segment, a.held_part, a.want_part) <
             std::tie(b.peer, b.depth, b.tensor, b.held_segment, b.want_segment, b.held_part, b.want_part);
    };
    std::sort(out_.sends.begin(), out_.sends.end(), order);
    std::sort(out_.receives.begin(), out_.receives.end(), order);
    return std::move(out_);
  }

 private:
  void walk() {
    for (uint32_t t = 0; t < job_.tensors.size(); ++t) {
      if (job_.held[t] == kNobody || job_.wanted[t] == kNobody) continue;
      const auto& shape = job_.tensors[t].shape;
      const uint64_t element = dtype_size(job_.tensors[t].dtype);
      const Side h(job_, job_.held[t], shape), w(job_, job_.wanted[t], shape);
      for (auto [q, j] : mine(h)) send_held(t, element, h, w, q, j);
      for (auto [q, j] : mine(w)) receive_wanted(t, element, h, w, q, j);
    }
  }

  // This rank's (replica, part) in a side: one for a rule, any number of
  // boxes for an explicit placement.
  std::vector<std::pair<int, uint32_t>> mine(const Side& s) const {
    std::vector<std::pair<int, uint32_t>> out;
    if (s.p->is_explicit()) {
      for (uint32_t j = 0; j < s.p->boxes.size(); ++j)
        if (s.p->boxes[j].rank == out_.rank) out.push_back({0, j});
    } else if (int i = at_[s.p->mesh]; i >= 0) {
      out.push_back({i / s.parts, static_cast<uint32_t>(i % s.parts)});
    }
    return out;
  }

  static uint64_t chain_rotation(uint32_t t, uint16_t sh, uint32_t jh, uint16_t sw, uint32_t jw, int replicas) {
    return (uint64_t{t} + sh + jh + sw + jw) % static_cast<uint64_t>(replicas);
  }
  // Part (q, jh) of the holders: each piece it is the chosen sender of goes
  // to the first wanter replica of the piece's chain.
  void send_held(uint32_t t, uint64_t element, const Side& h, const Side& w, int q, uint32_t jh) {
    const auto& shape = job_.tensors[t].shape;
    for (uint16_t sh = 0; sh < h.segments.size(); ++sh) {
      const Region box = h.box(shape, sh, jh);
      if (box.empty()) continue;
      each_meeting_part(w, shape, box, [&](uint16_t sw, uint32_t jw) {
        if (sending_replica(t, sw, jw, h.replicas) != q) return;
        const uint64_t n = meet(shape, h, sh, jh, w, sw, jw);
        if (!n) return;
        const int first = static_cast<int>(chain_rotation(t, sh, jh, sw, jw, w.replicas));
        add(true, n * element, t, w.rank(job_, first, jw), 0, jh, jw, sh, sw);
      });
    }
  }

  // Part (q, jw) of the wanters: each piece from its predecessor in the
  // chain (the holder for the first), and on to its successor.
  void receive_wanted(uint32_t t, uint64_t element, const Side& h, const Side& w, int q, uint32_t jw) {
    const auto& shape = job_.tensors[t].shape;
    for (uint16_t sw = 0; sw < w.segments.size(); ++sw) {
      const Region box = w.box(shape, sw, jw);
      if (box.empty()) continue;
      each_meeting_part(h, shape, box, [&](uint16_t sh, uint32_t jh) {
        const uint64_t n = meet(shape, h, sh, jh, w, sw, jw);
        if (!n) return;
        const auto rot = static_cast<int>(chain_rotation(t, sh, jh, sw, jw, w.replicas));
        const int at = (q - rot + w.replicas) % w.replicas;  // place in the chain
        const int from = at == 0 ? h.rank(job_, sending_replica(t, sw, jw, h.replicas), jh) : w.rank(job_, (rot + at - 1) % w.replicas, jw);
        add(false, n * element, t, from, at, jh, jw, sh, sw);
        if (at + 1 < w.replicas) add(true, n * element, t, w.rank(job_, (rot + at + 1) % w.replicas, jw), at + 1, jh, jw, sh, sw);
      });
    }
  }

  void add(bool send, uint64_t bytes, uint32_t t, int peer, int depth, uint32_t jh, uint32_t jw, uint16_t sh,
           uint16_t sw) {
    (send ? out_.bytes_out : out_.bytes_in) += bytes;
    if (counting_) {
      ++(send ? sends_ : receives_);
      return;
    }
    (send ? out_.sends : out_.receives)
        .push_back({bytes, t, static_cast<uint16_t>(peer), static_cast<uint16_t>(depth), static_cast<uint16_t>(jh),
                    static_cast<uint16_t>(jw), static_cast<uint8_t>(sh), static_cast<uint8_t>(sw)});
  }

  const JobLayout& job_;
  bool counting_ = false;
  size_t sends_ = 0, receives_ = 0;
  std::vector<int> at_;  // per mesh: this rank's index in it, or -1
  RankPlan out_;
};

}  // namespace

RankPlan rank_plan(const JobLayout& job, int rank) { return Planner(job, rank).run(); }

int move_holder(const JobLayout& job, const Move& m) {
  const auto& shape = job.tensors[m.tensor].shape;
  const Side h(job, job.held[m.tensor], shape), w(job, job.wanted[m.tensor], shape);
  return h.rank(job, Planner::sending_replica(m.tensor, m.want_segment, m.want_part, h.replicas), m.held_part);
}

Region move_region(const JobLayout& job, const Move& move) {
  const auto& shape = job.tensors[move.tensor].shape;
  const Side h(job, job.held[move.tensor], shape), w(job, job.wanted[move.tensor], shape);
  auto common = intersect(h.box(shape, move.held_segment, move.held_part),
                          w.box(shape, move.want_segment, move.want_part));
  return common ? *common : Region{};
}

std::vector<Batch> pair_batches(const std::vector<Move>& moves, uint64_t bucket_bytes) {
  std::vector<Batch> out;
  for (size_t i = 0; i < moves.size(); ++i) {
    const Move& m = moves[i];
    const bool joins = !out.empty() && m.bytes < bucket_bytes && out.back().bytes + m.bytes <= bucket_bytes &&
                       moves[i - 1].peer == m.peer && moves[i - 1].depth == m.depth &&
                       moves[i - 1].bytes < bucket_bytes;
    if (joins) {
      ++out.back().count;
      out.back().bytes += m.bytes;
    } else {
      out.push_back({i, 1, m.bytes});
    }
  }
  return out;
}

const RankPlan* PlanCache::find(const PlanKey& key, std::string* why) const {
  auto say = [&](std::string what) {
    if (why) *why = std::move(what);
    return nullptr;
  };
  if (!full_) return say("no plan cached yet");
  if (key.rank != key_.rank)
    return say("the cached plan is rank " + std::to_string(key_.rank) + "'s, this is rank " + std::to_string(key.rank));
  if (key.tensors != key_.tensors) return say("the tensor list changed (names, dtypes or shapes)");
  if (key.layout != key_.layout)
    return say("the layout changed (placements, meshes or ranks: an engine's slices, a rank that left, the EP map)");
  return &plan_;
}

const RankPlan& PlanCache::put(const PlanKey& key, RankPlan plan) {
  key_ = key;
  plan_ = std::move(plan);
  full_ = true;
  return plan_;
}

}  // namespace paramcast::reshard
