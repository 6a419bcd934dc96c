#include "common/reshard/sharded_update.h"

#include <cstring>
#include <map>
#include <set>
#include <string_view>
#include <unordered_map>

#include "common/xxhash.h"

namespace paramcast::reshard {

namespace {

// Rank r by its name in messages ("publisher", a worker id), or "rank r".
std::string rank_name(const std::vector<std::string>& names, int r) {
  return static_cast<size_t>(r) < names.size() && !names[static_cast<size_t>(r)].empty()
             ? names[static_cast<size_t>(r)]
             : "rank " + std::to_string(r);
}

}  // namespace

StatusOr<ShardedMoves> sharded_moves(const UpdatePlan& plan, int world, const std::vector<std::string>& names,
                                     const ReshardOptions& options) {
  const std::string where = "sharded update v" + std::to_string(plan.version);
  if (!plan.sharded) return invalid_argument(where + ": the plan is not sharded");
  std::map<int, RankManifest> by_rank;
  auto manifest = [&](int rank) -> RankManifest& {
    RankManifest& m = by_rank[rank];
    if (m.rank < 0) {
      m.rank = rank;
      m.name = rank_name(names, rank);
      m.tensors = plan.tensors;
    }
    return m;
  };
  for (const auto& h : plan.holders) {
    if (h.rank < 0 || h.rank >= world)
      return invalid_argument(where + ": holder rank " + std::to_string(h.rank) + " is not in a group of " +
                              std::to_string(world));
    RankManifest& m = manifest(h.rank);
    if (h.tensor < 0) continue;
    if (static_cast<size_t>(h.tensor) >= plan.tensors.size())
      return invalid_argument(where + ": " + m.name + " holds tensor #" + std::to_string(h.tensor) + " of " +
                              std::to_string(plan.tensors.size()));
    if (h.digest) m.digests[m.holds.size()] = *h.digest;
    m.holds.push_back({plan.tensors[static_cast<size_t>(h.tensor)].name, Region{h.offsets, h.lengths}});
  }
  if (!by_rank.count(0)) return invalid_argument(where + ": rank 0 (the publisher) is not among the holders");
  // Receivers: the ranks listed in `wanters` want their regions; the
  // others every tensor whole.
  std::map<int, std::vector<const UpdatePlan::Holding*>> wanted;
  for (const auto& w : plan.wanters) {
    if (w.rank < 0 || w.rank >= world || by_rank.count(w.rank))
      return invalid_argument(where + ": wanting rank " + std::to_string(w.rank) + " is not a receiver of a group of " +
                              std::to_string(world));
    if (w.tensor >= 0 && static_cast<size_t>(w.tensor) >= plan.tensors.size())
      return invalid_argument(where + ": rank " + std::to_string(w.rank) + " wants tensor #" + std::to_string(w.tensor));
    wanted[w.rank].push_back(&w);
  }
  ShardedMoves out;
  for (int r = 0; r < world; ++r) {
    if (by_rank.count(r)) continue;
    RankManifest& m = manifest(r);
    if (auto it = wanted.find(r); it != wanted.end()) {
      for (const auto* w : it->second)
        if (w->tensor >= 0)
          m.wants.push_back({plan.tensors[static_cast<size_t>(w->tensor)].name, Region{w->offsets, w->lengths}});
    } else {
      for (const auto& t : plan.tensors) m.wants.push_back({t.name, Region::whole(t.shape)});
    }
    out.receivers.push_back(r);
  }
  std::vector<RankManifest> ranks;
  for (auto& [r, m] : by_rank) ranks.push_back(std::move(m));
  auto p = plan_reshard(ranks, options);
  if (!p.ok()) return p.status().with_context(where);
  out.plan = std::move(p.value());
  // The moves' tensors are the update plan's, in its order: a transfer's
  // tensor is the plan's index, by which every rank finds its buffers.
  std::unordered_map<std::string_view, uint32_t> index;
  index.reserve(plan.tensors.size());
  for (size_t i = 0; i < plan.tensors.size(); ++i) index.emplace(plan.tensors[i].name, static_cast<uint32_t>(i));
  for (auto& x : out.plan.transfers) x.tensor = index.at(out.plan.tensors[x.tensor].name);
  out.plan.tensors = plan.tensors;
  out.by_name.reserve(out.plan.tensors.size());
  for (size_t i = 0; i < out.plan.tensors.size(); ++i) out.by_name.emplace(out.plan.tensors[i].name, i);
  out.rounds = schedule_rounds(out.plan);
  return out;
}

namespace {

// Everything the moves are derived from: the ranks under their names and
// the plan's shape (append_sharded_shape, common/plan.h).
std::string shape_of(const UpdatePlan& plan, int world, const std::vector<std::string>& names) {
  std::string out;
  const uint64_t w = static_cast<uint64_t>(world);
  out.append(reinterpret_cast<const char*>(&w), sizeof w);
  for (const auto& n : names) {
    const uint64_t size = n.size();
    out.append(reinterpret_cast<const char*>(&size), sizeof size);
    out += n;
  }
  append_sharded_shape(plan, out);
  return out;
}

// Two replicas of a region with different bytes, named.
Status replicas_differ(const UpdatePlan& plan, const std::vector<std::string>& names, const UpdatePlan::Holding& a,
                       const UpdatePlan::Holding& b) {
  const auto& t = plan.tensors[static_cast<size_t>(a.tensor)];
  return invalid_argument("sharded update v" + std::to_string(plan.version) +
                          ": the many-sender plan has 1 mismatch: tensor '" + t.name + "': " + rank_name(names, a.rank) +
                          " and " + rank_name(names, b.rank) + " hold " + Region{a.offsets, a.lengths}.to_string() +
                          " with different bytes (xxh64 " + digest_hex(*a.digest) + " and " + digest_hex(*b.digest) +
                          "): replicas must hold the same version");
}

// Calls `pair(a, b)` for each holder b whose box equals that of an earlier
// holder a of the same tensor, among the holders `counted` takes, until one
// fails: a counting sort by tensor, then each tensor's boxes sorted among
// themselves (no allocation per holder).
template <class Counted, class Pair>
Status for_each_replica(const UpdatePlan& plan, Counted counted, Pair pair) {
  const size_t tensors = plan.tensors.size();
  auto taken = [&](const UpdatePlan::Holding& h) {
    return h.tensor >= 0 && static_cast<size_t>(h.tensor) < tensors && counted(h);
  };
  std::vector<uint32_t> start(tensors + 1, 0);
  for (const auto& h : plan.holders)
    if (taken(h)) ++start[static_cast<size_t>(h.tensor) + 1];
  for (size_t t = 0; t < tensors; ++t) start[t + 1] += start[t];
  std::vector<uint32_t> order(start.back()), next(start.begin(), start.end() - 1);
  for (uint32_t i = 0; i < plan.holders.size(); ++i)
    if (taken(plan.holders[i])) order[next[static_cast<size_t>(plan.holders[i].tensor)]++] = i;
  auto box_less = [&](uint32_t a, uint32_t b) {
    const auto &x = plan.holders[a], &y = plan.holders[b];
    return x.offsets != y.offsets ? x.offsets < y.offsets : x.lengths < y.lengths;
  };
  for (size_t t = 0; t < tensors; ++t) {
    const auto begin = order.begin() + start[t], end = order.begin() + start[t + 1];
    if (end - begin < 2) continue;
    std::stable_sort(begin, end, box_less);  // equal boxes stay in plan order
    for (auto first = begin, it = begin + 1; it != end; ++it) {
      if (box_less(*first, *it)) {
        first = it;
        continue;
      }
      if (Status s = pair(plan.holders[*first], plan.holders[*it]); !s.ok()) return s;
    }
  }
  return Status();
}

// Replicas (holders of the same region of a tensor) whose digests differ:
// the check plan_reshard() makes, on its own for a cached plan.
Status check_replica_digests(const UpdatePlan& plan, const std::vector<std::string>& names) {
  return for_each_replica(
      plan, [](const UpdatePlan::Holding& h) { return h.digest.has_value(); },
      [&](const UpdatePlan::Holding& a, const UpdatePlan::Holding& b) {
        return *a.digest != *b.digest ? replicas_differ(plan, names, a, b) : Status();
      });
}

}  // namespace

StatusOr<std::shared_ptr<const ShardedMoves>> ShardedMovesCache::moves(const UpdatePlan& plan, int world,
                                                                       const std::vector<std::string>& names,
                                                                       KnownShape known) {
  const bool same = kept_ && (known.same_as_kept || (known.shape && known.shape == owner_ && world == world_ &&
                                                     names == names_));
  std::string shape = same ? std::string() : shape_of(plan, world, names);
  cached_ = kept_ && (same || shape == shape_);
  if (cached_) {
    if (known.shape && !same) owner_ = known.shape;  // the same bytes: that object's shape
    if (Status s = check_replica_digests(plan, names); !s.ok()) return s;
    return kept_;
  }
  kept_.reset();  // a failed plan keeps nothing
  auto fresh = sharded_moves(plan, world, names, options_);
  if (!fresh.ok()) return fresh.status();
  kept_ = std::make_shared<const ShardedMoves>(std::move(fresh.value()));
  shape_ = std::move(shape);
  owner_ = known.shape;
  world_ = world;
  names_ = names;
  return kept_;
}

std::shared_ptr<const BufferIndex> held_buffers(const ShardedMoves& moves, const std::vector<ShardView>& shards,
                                                const std::vector<std::pair<uint32_t, Region>>& boxes) {
  auto index = std::make_shared<BufferIndex>(moves.plan.tensors.size());
  for (const auto& [shard, box] : boxes)
    if (auto it = moves.by_name.find(shards[shard].local.spec.name); it != moves.by_name.end())
      index->add(it->second, static_cast<uint8_t*>(shards[shard].local.data), box);
  return index;
}

Status check_replicas_digested(const UpdatePlan& plan, const std::vector<std::string>& names) {
  auto filled = [](const UpdatePlan::Holding& h) {
    for (int64_t n : h.lengths)
      if (n <= 0) return false;
    return true;
  };
  return for_each_replica(plan, filled, [&](const UpdatePlan::Holding& a, const UpdatePlan::Holding& b) {
    if (a.digest && b.digest) return Status();
    const auto& missing = a.digest ? b : a;
    const auto& other = a.digest ? a : b;
    return invalid_argument("sharded update v" + std::to_string(plan.version) + ": tensor '" +
                            plan.tensors[static_cast<size_t>(a.tensor)].name + "': " + rank_name(names, missing.rank) +
                            " gave no digest of " + Region{missing.offsets, missing.lengths}.to_string() + ", which " +
                            rank_name(names, other.rank) + " holds too (data_plane.checksum compares replicas); " +
                            rank_name(names, missing.rank) + "'s next call states its part whole");
  });
}

}  // namespace paramcast::reshard
