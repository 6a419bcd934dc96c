#include "common/reshard/layout.h"

#include <algorithm>
#include <set>
#include <tuple>
#include <unordered_set>

namespace paramcast::reshard {
namespace {

constexpr size_t kMaxListed = 16;
constexpr int kMaxWorld = 1 << 16;
constexpr size_t kMaxExplicitBoxes = 4096;
constexpr size_t kMaxSegments = 255;  // a Move keeps the segment in a byte
constexpr int kMaxDims = 8;           // the wire's bound (layout_proto.h)  // per placement: pairwise checks stay small

// Collects problems: the first kMaxListed kept, the rest counted.
class Problems {
 public:
  void add(std::string what) {
    if (listed_.size() < kMaxListed) listed_.push_back(std::move(what));
    ++count_;
  }
  bool any() const { return count_ > 0; }
  Status status() const {
    if (!count_) return Status();
    std::string msg = "the job layout has " + std::to_string(count_) + " problem" + (count_ == 1 ? "" : "s") + ": ";
    for (size_t i = 0; i < listed_.size(); ++i) msg += (i ? "; " : "") + listed_[i];
    if (count_ > listed_.size()) msg += "; +" + std::to_string(count_ - listed_.size()) + " more";
    return invalid_argument(msg);
  }

 private:
  std::vector<std::string> listed_;
  size_t count_ = 0;
};

std::string quoted(const TensorSpec& t) { return "tensor '" + t.name + "' " + t.shape_string(); }

void check_meshes(const JobLayout& job, Problems& out) {
  for (size_t m = 0; m < job.meshes.size(); ++m) {
    const Mesh& mesh = job.meshes[m];
    const std::string where = "mesh #" + std::to_string(m);
    if (mesh.parts < 1 || mesh.replicas < 1 ||
        mesh.ranks.size() != static_cast<size_t>(mesh.parts) * static_cast<size_t>(mesh.replicas)) {
      out.add(where + ": " + std::to_string(mesh.ranks.size()) + " ranks for " + std::to_string(mesh.parts) +
              " parts x " + std::to_string(mesh.replicas) + " replicas");
      continue;
    }
    std::unordered_set<int> seen;
    for (int r : mesh.ranks) {
      if (r < 0 || r >= job.world()) out.add(where + ": rank " + std::to_string(r) + " is not in the group of " +
                                             std::to_string(job.world()));
      else if (!seen.insert(r).second) out.add(where + ": " + job.name(r) + " appears twice");
    }
  }
}

// A placement's own rules (its mesh, its boxes' ranks), once per placement.
void check_placements(const JobLayout& job, Problems& out) {
  for (size_t p = 0; p < job.placements.size(); ++p) {
    const Placement& pl = job.placements[p];
    const std::string where = "placement #" + std::to_string(p);
    if (pl.is_explicit()) {
      if (pl.boxes.size() > kMaxExplicitBoxes)
        out.add(where + ": " + std::to_string(pl.boxes.size()) + " explicit boxes, more than " +
                std::to_string(kMaxExplicitBoxes));
      for (const auto& b : pl.boxes)
        if (b.rank < 0 || b.rank >= job.world())
          out.add(where + ": rank " + std::to_string(b.rank) + " is not in the group of " + std::to_string(job.world()));
    } else if (pl.mesh >= job.meshes.size()) {
      out.add(where + ": mesh #" + std::to_string(pl.mesh) + " of " + std::to_string(job.meshes.size()));
    } else if (pl.dim < 0 || pl.dim >= kMaxDims) {
      out.add(where + ": along dim " + std::to_string(pl.dim) + " (0 to " + std::to_string(kMaxDims - 1) + ")");
    }
  }
}

// The placement fits the tensor: its dim exists, its segments add up, its
// explicit boxes lie inside and (holders) do not overlap.
bool check_fit(const JobLayout& job, const TensorSpec& t, const Placement& p, const char* verb, Problems& out) {
  if (p.is_explicit()) {
    bool ok = true;
    for (const auto& b : p.boxes)
      if (!b.box.inside(t.shape)) {
        out.add(quoted(t) + ": " + job.name(b.rank) + " " + verb + " " + b.box.to_string() + ", outside it");
        ok = false;
      }
    return ok;
  }
  const Mesh& mesh = job.meshes[p.mesh];
  if (mesh.parts > 1 && (p.dim < 0 || static_cast<size_t>(p.dim) >= t.shape.size())) {
    out.add(quoted(t) + ": sharded along dim " + std::to_string(p.dim) + ", which it does not have");
    return false;
  }
  if (p.segments.empty()) return true;
  if (p.dim < 0 || static_cast<size_t>(p.dim) >= t.shape.size()) {
    out.add(quoted(t) + ": segments along dim " + std::to_string(p.dim) + ", which it does not have");
    return false;
  }
  if (p.segments.size() > kMaxSegments) {
    out.add(quoted(t) + ": " + std::to_string(p.segments.size()) + " segments, more than " +
            std::to_string(kMaxSegments));
    return false;
  }
  const int64_t extent = t.shape[static_cast<size_t>(p.dim)];
  int64_t sum = 0;
  for (int64_t s : p.segments) {
    if (s <= 0 || s > extent - sum) {  // never past the dim: no sum can wrap
      out.add(quoted(t) + ": a segment of " + std::to_string(s) + " rows after " + std::to_string(sum) +
              " along dim " + std::to_string(p.dim) + " of " + std::to_string(extent));
      return false;
    }
    sum += s;
  }
  if (sum != extent) {
    out.add(quoted(t) + ": segments of " + std::to_string(sum) + " rows along dim " + std::to_string(p.dim) +
            ", expected " + std::to_string(extent));
    return false;
  }
  return true;
}

void check_explicit_holders(const JobLayout& job, const TensorSpec& t, const Placement& p, Problems& out) {
  for (size_t a = 0; a < p.boxes.size(); ++a)
    for (size_t b = a + 1; b < p.boxes.size(); ++b)
      if (auto common = intersect(p.boxes[a].box, p.boxes[b].box))
        out.add(quoted(t) + ": " + job.name(p.boxes[a].rank) + " holds " + p.boxes[a].box.to_string() + " and " +
                job.name(p.boxes[b].rank) + " holds " + p.boxes[b].box.to_string() + ": both claim " +
                common->to_string());
}

// What of `want` no explicit holder covers, named (the first 4 pieces).
void check_gaps(const TensorSpec& t, const RankBox& want, const Placement& h, const char* who,
                Problems& out) {
  std::vector<Region> gaps = {want.box};
  for (const auto& held : h.boxes) {
    std::vector<Region> left;
    for (const auto& g : gaps)
      for (auto& piece : subtract(g, held.box)) left.push_back(std::move(piece));
    gaps = std::move(left);
  }
  for (size_t g = 0; g < gaps.size() && g < 4; ++g)
    out.add(quoted(t) + ": " + who + " " + gaps[g].to_string() + ", which no rank holds");
}

// Explicit wants: one rank's boxes never overlap, and explicit holders
// leave no gap in them (rule holders cover the whole tensor).
void check_explicit_wants(const JobLayout& job, const TensorSpec& t, const Placement& w, const Placement* h,
                          Problems& out) {
  for (size_t a = 0; a < w.boxes.size(); ++a) {
    for (size_t b = a + 1; b < w.boxes.size(); ++b)
      if (w.boxes[a].rank == w.boxes[b].rank)
        if (auto common = intersect(w.boxes[a].box, w.boxes[b].box))
          out.add(quoted(t) + ": " + job.name(w.boxes[a].rank) + " wants " + w.boxes[a].box.to_string() + " and " +
                  w.boxes[b].box.to_string() + ", which overlap at " + common->to_string());
    if (h && h->is_explicit()) check_gaps(t, w.boxes[a], *h, (job.name(w.boxes[a].rank) + " wants").c_str(), out);
  }
}

std::vector<int> ranks_of(const JobLayout& job, const Placement& p) {
  if (!p.is_explicit()) return job.meshes[p.mesh].ranks;
  std::vector<int> out;
  for (const auto& b : p.boxes) out.push_back(b.rank);
  return out;
}

// No rank both holds and wants a tensor (the holders send, the others
// receive): checked once per distinct pair of placements.
// The explicit side(s) of one tensor: holders that never overlap, wants
// that never overlap per rank, and explicit holders that leave no gap in
// what is wanted (a rule's wanters want the whole tensor between them).
void check_explicit(const JobLayout& job, const TensorSpec& t, const Placement& h, const Placement* w, Problems& out) {
  if (h.is_explicit()) check_explicit_holders(job, t, h, out);
  if (!w) return;
  if (w->is_explicit()) {
    check_explicit_wants(job, t, *w, &h, out);
  } else if (h.is_explicit()) {
    Placement whole;
    whole.boxes.push_back({-1, Region::whole(t.shape)});
    check_gaps(t, whole.boxes[0], h, "the wanters want", out);
  }
}

void check_sides(const JobLayout& job, uint32_t held, uint32_t wanted, const TensorSpec& t,
                 std::set<std::pair<uint32_t, uint32_t>>& seen, Problems& out) {
  if (!seen.insert({held, wanted}).second) return;
  std::vector<int> h = ranks_of(job, job.placements[held]), w = ranks_of(job, job.placements[wanted]);
  std::sort(h.begin(), h.end());
  for (int r : w)
    if (std::binary_search(h.begin(), h.end(), r)) {
      out.add(quoted(t) + " (and every tensor placed alike): " + job.name(r) + " both holds and wants it");
      return;
    }
}

void check_tensors(const JobLayout& job, Problems& out) {
  std::unordered_set<std::string> names;
  std::set<std::pair<uint32_t, uint32_t>> sides;
  std::set<std::tuple<uint32_t, uint32_t, std::vector<int64_t>>> explicit_checked;
  const auto n = static_cast<uint32_t>(job.placements.size());
  for (size_t i = 0; i < job.tensors.size(); ++i) {
    const TensorSpec& t = job.tensors[i];
    if (!names.insert(t.name).second) out.add("tensor '" + t.name + "' is listed twice");
    if (auto bytes = t.nbytes(); !bytes.ok()) out.add("tensor '" + t.name + "': " + bytes.status().message());
    const uint32_t h = job.held[i], w = job.wanted[i];
    if (h != kNobody && h >= n) out.add(quoted(t) + ": held by placement #" + std::to_string(h));
    if (w != kNobody && w >= n) out.add(quoted(t) + ": wanted by placement #" + std::to_string(w));
    if ((h != kNobody && h >= n) || (w != kNobody && w >= n)) continue;
    if (h == kNobody && w != kNobody) {
      out.add(quoted(t) + " is wanted, and no rank holds it");
      continue;
    }
    const bool held_fits = h != kNobody && check_fit(job, t, job.placements[h], "holds", out);
    const bool wanted_fits = held_fits && w != kNobody && check_fit(job, t, job.placements[w], "wants", out);
    // Explicit boxes cost pairwise checks: once per (placements, shape),
    // however many tensors share them.
    const bool any_explicit = h != kNobody && (job.placements[h].is_explicit() ||
                                               (w != kNobody && job.placements[w].is_explicit()));
    if (held_fits && any_explicit && explicit_checked.insert({h, w, t.shape}).second)
      check_explicit(job, t, job.placements[h], wanted_fits ? &job.placements[w] : nullptr, out);
    if (wanted_fits) check_sides(job, h, w, t, sides, out);
  }
}

}  // namespace

std::string JobLayout::name(int rank) const {
  if (rank >= 0 && rank < world() && !rank_names[static_cast<size_t>(rank)].empty())
    return rank_names[static_cast<size_t>(rank)];
  return "rank " + std::to_string(rank);
}

std::vector<Segment> segments_of(const Placement& p, const std::vector<int64_t>& shape) {
  if (p.segments.empty()) {
    const auto d = static_cast<size_t>(p.dim);
    return {Segment{0, d < shape.size() ? shape[d] : 1}};
  }
  std::vector<Segment> out;
  int64_t at = 0;
  for (int64_t s : p.segments) {
    out.push_back({at, s});
    at += s;
  }
  return out;
}

Segment chunk_of(const Segment& s, int parts, int j) {
  const int64_t chunk = (s.size + parts - 1) / parts;
  const int64_t first = std::min(s.size, chunk * j);
  return {s.start + first, std::min(s.size, first + chunk) - first};
}

Region part_box(const Placement& p, const std::vector<int64_t>& shape, const Segment& s, int parts, int j) {
  Region box = Region::whole(shape);
  const auto d = static_cast<size_t>(p.dim);
  if (d >= shape.size()) return box;  // a scalar, or a whole tensor without segments
  const Segment c = chunk_of(s, parts, j);
  box.offsets[d] = c.start;
  box.lengths[d] = c.size;
  return box;
}

Status check_layout(const JobLayout& job) {
  Problems out;
  if (job.world() < 1 || job.world() > kMaxWorld)
    out.add("a group of " + std::to_string(job.world()) + " ranks (1 to " + std::to_string(kMaxWorld) + ")");
  if (job.held.size() != job.tensors.size() || job.wanted.size() != job.tensors.size())
    out.add(std::to_string(job.tensors.size()) + " tensors, " + std::to_string(job.held.size()) + " holder and " +
            std::to_string(job.wanted.size()) + " wanter placements");
  if (out.any()) return out.status();
  check_meshes(job, out);
  check_placements(job, out);
  if (!out.any()) check_tensors(job, out);
  return out.status();
}

std::vector<RankManifest> expand(const JobLayout& job) {
  std::vector<RankManifest> ranks(static_cast<size_t>(job.world()));
  std::vector<size_t> stated(ranks.size(), SIZE_MAX);  // the last tensor each rank stated
  for (int r = 0; r < job.world(); ++r) ranks[static_cast<size_t>(r)] = {r, job.name(r), {}, {}, {}, {}};
  auto state = [&](int rank, size_t t, const Region& box, bool holds) {
    auto& m = ranks[static_cast<size_t>(rank)];
    if (stated[static_cast<size_t>(rank)] != t) m.tensors.push_back(job.tensors[t]);
    stated[static_cast<size_t>(rank)] = t;
    (holds ? m.holds : m.wants).push_back({job.tensors[t].name, box});
  };
  auto place = [&](size_t t, uint32_t pi, bool holds) {
    if (pi == kNobody) return;
    const Placement& p = job.placements[pi];
    const auto& shape = job.tensors[t].shape;
    if (p.is_explicit()) {
      for (const auto& b : p.boxes) state(b.rank, t, b.box, holds);
      return;
    }
    const Mesh& mesh = job.meshes[p.mesh];
    for (size_t i = 0; i < mesh.ranks.size(); ++i)
      for (const Segment& s : segments_of(p, shape)) {
        Region box = part_box(p, shape, s, mesh.parts, static_cast<int>(i) % mesh.parts);
        if (!box.empty()) state(mesh.ranks[i], t, box, holds);
      }
  };
  for (size_t t = 0; t < job.tensors.size(); ++t) {
    place(t, job.held[t], true);
    place(t, job.wanted[t], false);
  }
  return ranks;
}

}  // namespace paramcast::reshard
