#include "common/reshard/layout_proto.h"

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <algorithm>
#include <cstring>

#include "common/xxhash.h"
#include "schemas/control.capnp.h"

namespace paramcast::reshard {
namespace {

void put_varint(std::vector<uint8_t>& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<uint8_t>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<uint8_t>(v));
}

// Reads a LEB128 varint of at most 5 bytes (a name length), or false.
bool get_varint(const uint8_t*& at, const uint8_t* end, uint64_t& v) {
  v = 0;
  for (int shift = 0; shift < 35 && at < end; shift += 7) {
    const uint8_t b = *at++;
    v |= uint64_t{b & 0x7fu} << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

std::vector<uint8_t> front_coded(const std::vector<TensorSpec>& tensors) {
  std::vector<uint8_t> out;
  const std::string* last = nullptr;
  for (const auto& t : tensors) {
    size_t shared = 0;
    if (last)
      while (shared < last->size() && shared < t.name.size() && (*last)[shared] == t.name[shared]) ++shared;
    put_varint(out, shared);
    put_varint(out, t.name.size() - shared);
    out.insert(out.end(), t.name.begin() + static_cast<long>(shared), t.name.end());
    last = &t.name;
  }
  return out;
}

Status names_from(capnp::Data::Reader names, std::vector<TensorSpec>& tensors, const LayoutLimits& limits) {
  const uint8_t *at = names.begin(), *end = names.end();
  const std::string* last = nullptr;
  for (size_t i = 0; i < tensors.size(); ++i) {
    uint64_t shared = 0, more = 0;
    if (!get_varint(at, end, shared) || !get_varint(at, end, more))
      return invalid_argument("layout: the name of tensor #" + std::to_string(i) + " is cut short");
    if ((last ? shared > last->size() : shared > 0) || more > limits.max_name_bytes ||
        shared + more > limits.max_name_bytes || more > static_cast<uint64_t>(end - at))
      return invalid_argument("layout: the name of tensor #" + std::to_string(i) + " (" + std::to_string(shared) +
                              " shared + " + std::to_string(more) + " bytes) is out of bounds (names of at most " +
                              std::to_string(limits.max_name_bytes) + " bytes)");
    std::string& name = tensors[i].name;
    if (last) name.assign(*last, 0, shared);
    name.append(reinterpret_cast<const char*>(at), more);
    at += more;
    if (name.empty()) return invalid_argument("layout: tensor #" + std::to_string(i) + " has an empty name");
    last = &name;
  }
  if (at != end) return invalid_argument("layout: " + std::to_string(end - at) + " bytes after the last name");
  return Status();
}

void placement_to(const Placement& p, proto::LayoutPlacement::Builder out) {
  out.setMesh(p.mesh);
  out.setDim(static_cast<uint32_t>(p.dim));
  auto segs = out.initSegments(static_cast<unsigned>(p.segments.size()));
  for (unsigned i = 0; i < segs.size(); ++i) segs.set(i, p.segments[i]);
  auto boxes = out.initBoxes(static_cast<unsigned>(p.boxes.size()));
  for (unsigned i = 0; i < boxes.size(); ++i) {
    const RankBox& b = p.boxes[i];
    boxes[i].setRank(static_cast<uint32_t>(b.rank));
    auto o = boxes[i].initOffsets(static_cast<unsigned>(b.box.offsets.size()));
    auto l = boxes[i].initLengths(static_cast<unsigned>(b.box.lengths.size()));
    for (unsigned d = 0; d < o.size(); ++d) o.set(d, b.box.offsets[d]);
    for (unsigned d = 0; d < l.size(); ++d) l.set(d, b.box.lengths[d]);
  }
}

StatusOr<Placement> placement_from(proto::LayoutPlacement::Reader in, size_t& boxes_left, const LayoutLimits& limits) {
  Placement p;
  p.mesh = in.getMesh();
  if (in.getDim() >= limits.max_dims) return invalid_argument("layout: a placement along dim " + std::to_string(in.getDim()));
  p.dim = static_cast<int>(in.getDim());
  const auto segments = in.getSegments();
  const auto boxes = in.getBoxes();
  if (segments.size() > (1u << 16)) return invalid_argument("layout: a placement of more than 65536 segments");
  for (int64_t s : segments) p.segments.push_back(s);
  if (boxes.size() > boxes_left)
    return invalid_argument("layout: more than " + std::to_string(limits.max_boxes) + " explicit boxes");
  boxes_left -= boxes.size();
  for (auto b : boxes) {
    const auto offsets = b.getOffsets(), lengths = b.getLengths();
    if (offsets.size() > limits.max_dims || lengths.size() != offsets.size())
      return invalid_argument("layout: an explicit box of " + std::to_string(offsets.size()) + " offsets and " +
                              std::to_string(lengths.size()) + " lengths");
    RankBox box{static_cast<int>(std::min<uint32_t>(b.getRank(), 1u << 30)), {}};
    for (int64_t o : offsets) box.box.offsets.push_back(o);
    for (int64_t l : lengths) box.box.lengths.push_back(l);
    p.boxes.push_back(std::move(box));
  }
  return p;
}

Status tensors_from(proto::JobLayoutTable::Reader in, JobLayout& job, const LayoutLimits& limits) {
  // Each list is read once: every get counts its words against the traversal limit.
  const auto dtypes = in.getDtypes(), ranks = in.getRanks();
  const auto held = in.getHeld(), wanted = in.getWanted();
  const size_t n = dtypes.size();
  if (n > limits.max_tensors)
    return invalid_argument("layout: " + std::to_string(n) + " tensors, more than " + std::to_string(limits.max_tensors));
  if (ranks.size() != n || held.size() != n || wanted.size() != n)
    return invalid_argument("layout: the per-tensor lists disagree on the number of tensors");
  job.tensors.resize(n);
  size_t dims_at = 0;
  const auto dims = in.getDims();
  for (size_t i = 0; i < n; ++i) {
    TensorSpec& t = job.tensors[i];
    const auto i_ = static_cast<unsigned>(i);
    if (dtypes[i_] >= kNumDTypes)
      return invalid_argument("layout: tensor #" + std::to_string(i) + " has dtype " + std::to_string(dtypes[i_]));
    t.dtype = static_cast<DType>(dtypes[i_]);
    const size_t rank = ranks[i_];
    if (rank > limits.max_dims || dims_at + rank > dims.size())
      return invalid_argument("layout: tensor #" + std::to_string(i) + " has " + std::to_string(rank) + " dimensions");
    for (size_t d = 0; d < rank; ++d) {
      const int64_t v = dims[static_cast<unsigned>(dims_at++)];
      if (v < 0) return invalid_argument("layout: tensor #" + std::to_string(i) + " has a negative dimension");
      t.shape.push_back(v);
    }
    job.held.push_back(held[i_]);
    job.wanted.push_back(wanted[i_]);
  }
  if (dims_at != dims.size()) return invalid_argument("layout: dimensions left over after the last tensor");
  if (Status s = names_from(in.getNames(), job.tensors, limits); !s.ok()) return s;
  if (tensors_digest(job.tensors) != in.getTensorsDigest())
    return invalid_argument("layout: the tensor list does not hash to the digest it came with");
  return Status();
}

Status rules_from(proto::JobLayoutTable::Reader in, JobLayout& job, const LayoutLimits& limits) {
  const auto names = in.getRankNames();
  if (names.size() > limits.max_ranks) return invalid_argument("layout: a group of " + std::to_string(names.size()) + " ranks");
  for (auto name : names) job.rank_names.emplace_back(name.cStr(), std::min<size_t>(name.size(), 256));
  size_t mesh_ranks = 0;
  for (auto m : in.getMeshes()) {
    const auto ranks = m.getRanks();
    mesh_ranks += ranks.size();
    if (mesh_ranks > limits.max_mesh_ranks || job.meshes.size() >= limits.max_placements)
      return invalid_argument("layout: meshes of more than " + std::to_string(limits.max_mesh_ranks) + " ranks in all");
    Mesh mesh{static_cast<int>(std::min<uint32_t>(m.getParts(), 1u << 30)),
              static_cast<int>(std::min<uint32_t>(m.getReplicas(), 1u << 30)), {}};
    for (uint32_t r : ranks) mesh.ranks.push_back(static_cast<int>(std::min<uint32_t>(r, 1u << 30)));
    job.meshes.push_back(std::move(mesh));
  }
  const auto placements = in.getPlacements();
  if (placements.size() > limits.max_placements)
    return invalid_argument("layout: " + std::to_string(placements.size()) + " placements");
  size_t boxes_left = limits.max_boxes;
  for (auto p : placements) {
    auto placement = placement_from(p, boxes_left, limits);
    if (!placement.ok()) return placement.status();
    job.placements.push_back(std::move(placement.value()));
  }
  return Status();
}

}  // namespace

uint64_t tensors_digest(const std::vector<TensorSpec>& tensors) {
  std::vector<uint8_t> bytes;
  for (const auto& t : tensors) {
    put_varint(bytes, t.name.size());
    bytes.insert(bytes.end(), t.name.begin(), t.name.end());
    bytes.push_back(static_cast<uint8_t>(t.dtype));
    put_varint(bytes, t.shape.size());
    for (int64_t d : t.shape) put_varint(bytes, static_cast<uint64_t>(d));
  }
  return xxh64(bytes.data(), bytes.size());
}

PlanKey plan_key(const JobLayout& job, const std::vector<uint8_t>& bytes, int rank) {
  return {tensors_digest(job.tensors), xxh64(bytes.data(), bytes.size()), rank};
}

std::vector<uint8_t> layout_bytes(const JobLayout& job) {
  capnp::MallocMessageBuilder message;
  auto out = message.initRoot<proto::JobLayoutTable>();
  const auto n = static_cast<unsigned>(job.tensors.size());
  const std::vector<uint8_t> names = front_coded(job.tensors);
  out.setNames(capnp::Data::Reader(names.data(), names.size()));
  auto dtypes = out.initDtypes(n);
  auto ranks = out.initRanks(n);
  size_t dims = 0;
  for (unsigned i = 0; i < n; ++i) {
    dtypes.set(i, static_cast<uint8_t>(job.tensors[i].dtype));
    ranks.set(i, static_cast<uint8_t>(job.tensors[i].shape.size()));
    dims += job.tensors[i].shape.size();
  }
  auto shape = out.initDims(static_cast<unsigned>(dims));
  unsigned at = 0;
  for (const auto& t : job.tensors)
    for (int64_t d : t.shape) shape.set(at++, d);
  out.setTensorsDigest(tensors_digest(job.tensors));
  auto rank_names = out.initRankNames(static_cast<unsigned>(job.rank_names.size()));
  for (unsigned i = 0; i < rank_names.size(); ++i) rank_names.set(i, job.rank_names[i]);
  auto meshes = out.initMeshes(static_cast<unsigned>(job.meshes.size()));
  for (unsigned i = 0; i < meshes.size(); ++i) {
    meshes[i].setParts(static_cast<uint32_t>(job.meshes[i].parts));
    meshes[i].setReplicas(static_cast<uint32_t>(job.meshes[i].replicas));
    auto r = meshes[i].initRanks(static_cast<unsigned>(job.meshes[i].ranks.size()));
    for (unsigned k = 0; k < r.size(); ++k) r.set(k, static_cast<uint32_t>(job.meshes[i].ranks[k]));
  }
  auto placements = out.initPlacements(static_cast<unsigned>(job.placements.size()));
  for (unsigned i = 0; i < placements.size(); ++i) placement_to(job.placements[i], placements[i]);
  auto held = out.initHeld(n), wanted = out.initWanted(n);
  for (unsigned i = 0; i < n; ++i) {
    held.set(i, job.held[i]);
    wanted.set(i, job.wanted[i]);
  }
  auto flat = capnp::messageToFlatArray(message);
  auto bytes = flat.asBytes();
  return std::vector<uint8_t>(bytes.begin(), bytes.end());
}

StatusOr<JobLayout> layout_from_bytes(const std::vector<uint8_t>& bytes, const LayoutLimits& limits) {
  if (bytes.empty() || bytes.size() % sizeof(capnp::word) != 0)
    return invalid_argument("layout: " + std::to_string(bytes.size()) + " bytes, not whole 8-byte words");
  auto words = kj::heapArray<capnp::word>(bytes.size() / sizeof(capnp::word));
  std::memcpy(words.begin(), bytes.data(), bytes.size());
  capnp::ReaderOptions options;
  options.traversalLimitInWords = words.size() * 4 + 1024;
  JobLayout job;
  try {
    capnp::FlatArrayMessageReader reader(words.asPtr(), options);
    auto in = reader.getRoot<proto::JobLayoutTable>();
    if (Status s = tensors_from(in, job, limits); !s.ok()) return s;
    if (Status s = rules_from(in, job, limits); !s.ok()) return s;
  } catch (const kj::Exception& e) {
    return invalid_argument(std::string("layout: undecodable: ") + e.getDescription().cStr());
  }
  return job;
}

}  // namespace paramcast::reshard
