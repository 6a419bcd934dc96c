// Layouts stated by rule (common/reshard/layout.h) and each rank's own
// part of them (rank_plan.h), held to the explicit planner: over random
// layouts of small models, the per-rank plans agree end to end, deliver
// every wanted element exactly once (validate_plan), and move the same
// pieces plan_reshard() moves for the same job written out region by region.
// Pure: no process, no socket.
#include "common/reshard/rank_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "common/reshard/layout_proto.h"
#include "tests/support/frontier_shapes.h"

namespace paramcast::reshard {
namespace {

std::string label(const char* prefix, int i) {
  std::string s = prefix;
  s += std::to_string(i);
  return s;
}

// A job of M holder ranks (0..M-1) and R x T wanter ranks after them.
struct JobBuilder {
  JobLayout job;
  int holders = 0, replicas = 0, tp = 0;

  JobBuilder(int m, int r, int t) : holders(m), replicas(r), tp(t) {
    for (int i = 0; i < m; ++i) job.rank_names.push_back(label("trainer-", i));
    for (int i = 0; i < r * t; ++i) job.rank_names.push_back(label("worker-", i));
  }
  uint32_t mesh(int parts, int reps, std::vector<int> ranks) {
    job.meshes.push_back({parts, reps, std::move(ranks)});
    return static_cast<uint32_t>(job.meshes.size() - 1);
  }
  uint32_t place(Placement p) {
    job.placements.push_back(std::move(p));
    return static_cast<uint32_t>(job.placements.size() - 1);
  }
  // Shard(dim) over the M holders (FSDP2).
  uint32_t fsdp(int dim) {
    std::vector<int> r(static_cast<size_t>(holders));
    for (int i = 0; i < holders; ++i) r[static_cast<size_t>(i)] = i;
    return place({mesh(holders, 1, r), dim, {}, {}});
  }
  // Shard(dim) over T engine ranks of each of R replicas (a TP slice).
  uint32_t tp_slice(int dim, std::vector<int64_t> segments = {}) {
    std::vector<int> r;
    for (int i = 0; i < replicas * tp; ++i) r.push_back(holders + i);
    return place({mesh(tp, replicas, r), dim, std::move(segments), {}});
  }
  // Whole on engine rank `ep` of every replica (an expert on its EP rank).
  uint32_t on_ep_rank(int ep) {
    std::vector<int> r;
    for (int q = 0; q < replicas; ++q) r.push_back(holders + q * tp + ep);
    return place({mesh(1, replicas, r), 0, {}, {}});
  }
  uint32_t whole_on(std::vector<int> ranks, int reps) { return place({mesh(1, reps, std::move(ranks)), 0, {}, {}}); }
  void tensor(const std::string& name, std::vector<int64_t> shape, uint32_t held, uint32_t wanted,
              DType dtype = DType::kBF16) {
    job.tensors.push_back({name, dtype, std::move(shape)});
    job.held.push_back(held);
    job.wanted.push_back(wanted);
  }
};

using PieceKey = std::tuple<int, std::string, Region>;  // (receiver, tensor, region)

// Every rank's plan; each pair's sends on one end are the receives on the
// other, in the same order; returns them as a ReshardPlan (chains linked
// by `after`) for validate_plan.
ReshardPlan assemble(const JobLayout& job) {
  std::vector<RankPlan> plans;
  for (int r = 0; r < job.world(); ++r) plans.push_back(rank_plan(job, r));
  std::map<std::pair<int, int>, std::vector<Move>> sent, got;
  for (const auto& p : plans) {
    for (const auto& m : p.sends) sent[{p.rank, m.peer}].push_back(m);
    for (const auto& m : p.receives) got[{m.peer, p.rank}].push_back(m);
  }
  EXPECT_EQ(sent.size(), got.size());
  for (const auto& [pair, moves] : sent) {
    std::vector<Move> theirs = got[pair];
    for (auto& m : theirs) m.peer = static_cast<uint16_t>(pair.second);  // the receiver's moves name their sender
    EXPECT_EQ(moves, theirs) << job.name(pair.first) << " -> " << job.name(pair.second);
    EXPECT_EQ(pair_batches(got[pair], 1024).size(), pair_batches(sent[pair], 1024).size());
  }
  ReshardPlan out;
  out.tensors = job.tensors;
  std::map<std::tuple<int, uint32_t, uint32_t, uint32_t, uint16_t, uint16_t>, int> landed;
  for (uint32_t depth = 0;; ++depth) {
    bool any = false;
    for (const auto& p : plans)
      for (const auto& m : p.sends) {
        if (m.depth != depth) continue;
        any = true;
        int after = -1;
        if (depth == 0) {
          EXPECT_EQ(move_holder(job, m), p.rank);
        }
        if (depth > 0) {
          auto it = landed.find({p.rank, m.tensor, m.held_part, m.want_part, m.held_segment, m.want_segment});
          EXPECT_NE(it, landed.end()) << job.name(p.rank) << " forwards a piece it never received";
          if (it != landed.end()) after = it->second;
          if (after >= 0) {
            EXPECT_EQ(out.transfers[chain_start(out, static_cast<size_t>(after))].from, move_holder(job, m));
          }
        }
        out.transfers.push_back({p.rank, m.peer, m.tensor, move_region(job, m), m.bytes, after});
        landed[{m.peer, m.tensor, m.held_part, m.want_part, m.held_segment, m.want_segment}] =
            static_cast<int>(out.transfers.size() - 1);
      }
    if (!any) break;
  }
  return out;
}

std::set<PieceKey> pieces_of(const ReshardPlan& p) {
  std::set<PieceKey> out;
  for (const auto& x : p.transfers) out.insert({x.to, p.tensors[x.tensor].name, x.region});
  return out;
}

// The per-rank plans against plan_reshard() of the same job written out.
void expect_same_as_explicit(const JobLayout& job) {
  ASSERT_TRUE(check_layout(job).ok()) << check_layout(job).message();
  const auto manifests = expand(job);
  ReshardPlan mine = assemble(job);
  Status valid = validate_plan(mine, manifests);
  EXPECT_TRUE(valid.ok()) << valid.message();
  auto reference = plan_reshard(manifests);
  ASSERT_TRUE(reference.ok()) << reference.status().message();
  std::set<PieceKey> theirs;
  for (const auto& x : reference->transfers) theirs.insert({x.to, reference->tensors[x.tensor].name, x.region});
  EXPECT_EQ(pieces_of(mine), theirs);
}

TEST(LayoutTest, FsdpToTensorParallelEnginesMovesWhatTheExplicitPlannerMoves) {
  JobBuilder b(4, 2, 2);
  const uint32_t rows = b.fsdp(0), cols = b.fsdp(1);
  b.tensor("embed", {10, 6}, rows, b.tp_slice(0));
  b.tensor("o_proj", {6, 9}, rows, b.tp_slice(1));                 // row-parallel: columns
  b.tensor("gate_up", {14, 4}, rows, b.tp_slice(0, {7, 7}));        // fused segments
  b.tensor("norm", {6}, rows, b.whole_on({4, 5, 6, 7}, 4));          // every engine rank whole
  b.tensor("expert.0", {5, 4}, b.whole_on({1}, 1), b.on_ep_rank(0));
  b.tensor("expert.1", {5, 4}, b.whole_on({2}, 1), b.on_ep_rank(1));
  b.tensor("by_columns", {3, 10}, cols, b.tp_slice(0));            // holders cut columns, wanters rows
  b.tensor("replicated", {4, 4}, b.whole_on({0, 1, 2, 3}, 4), b.tp_slice(0));
  expect_same_as_explicit(b.job);
}

TEST(LayoutTest, ExplicitBoxesMixWithRules) {
  JobBuilder b(3, 2, 2);
  const uint32_t held = b.place({0, 0, {}, {{0, Region::slice({8, 4}, 0, 0, 3)}, {2, Region::slice({8, 4}, 0, 3, 5)}}});
  const uint32_t wanted =
      b.place({0, 0, {}, {{3, Region::slice({8, 4}, 1, 0, 1)}, {6, Region::slice({8, 4}, 1, 1, 3)}}});
  b.tensor("odd", {8, 4}, held, b.tp_slice(1));
  b.tensor("odd_want", {8, 4}, b.fsdp(0), wanted);
  b.tensor("both", {8, 4}, held, wanted);
  expect_same_as_explicit(b.job);
}

// Random small jobs: holders by Shard(d) over some ranks with replicas,
// whole on one rank, or explicit row cuts; wanters by TP slices (with
// segments), whole on EP ranks, whole everywhere, or explicit.
TEST(LayoutTest, RandomLayoutsPlanTheSamePiecesAsExplicitRegions) {
  std::mt19937 rng(20261206);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  for (int trial = 0; trial < 60; ++trial) {
    const int m = 1 + pick(6), r = 1 + pick(3), t = 1 + pick(4);
    JobBuilder b(m, r, t);
    const int tensors = 1 + pick(12);
    for (int i = 0; i < tensors; ++i) {
      std::vector<int64_t> shape = {1 + pick(13)};
      if (pick(3)) shape.push_back(1 + pick(9));
      if (!pick(5)) shape.push_back(1 + pick(3));
      const int dim = pick(static_cast<int>(shape.size()));
      uint32_t held = 0;
      switch (pick(4)) {
        case 0: held = b.fsdp(dim); break;
        case 1: held = b.whole_on({pick(m)}, 1); break;
        case 2: {  // Shard over half the holders, replicated over the other half
          const int parts = std::max(1, m / 2), reps = m / parts;
          std::vector<int> ranks;
          for (int k = 0; k < parts * reps; ++k) ranks.push_back(k);
          held = b.place({b.mesh(parts, reps, ranks), dim, {}, {}});
          break;
        }
        default: {  // explicit cuts of dim 0, each to a random holder
          Placement p;
          for (int64_t at = 0; at < shape[0];) {
            const int64_t n = std::min<int64_t>(shape[0] - at, 1 + pick(4));
            p.boxes.push_back({pick(m), Region::slice(shape, 0, at, n)});
            at += n;
          }
          held = b.place(std::move(p));
        }
      }
      uint32_t wanted = 0;
      switch (pick(4)) {
        case 0: {
          std::vector<int64_t> segs;
          if (shape[static_cast<size_t>(dim)] >= 2 && pick(2))
            segs = {shape[static_cast<size_t>(dim)] / 2, shape[static_cast<size_t>(dim)] - shape[static_cast<size_t>(dim)] / 2};
          wanted = b.tp_slice(dim, segs);
          break;
        }
        case 1: wanted = b.on_ep_rank(pick(t)); break;
        case 2: {
          std::vector<int> all;
          for (int k = 0; k < r * t; ++k) all.push_back(m + k);
          wanted = b.whole_on(all, r * t);
          break;
        }
        default: {
          Placement p;
          const auto last = shape.size() - 1;
          for (int64_t at = 0; at < shape[last];) {
            const int64_t n = std::min<int64_t>(shape[last] - at, 1 + pick(3));
            p.boxes.push_back({m + pick(r * t), Region::slice(shape, static_cast<int>(last), at, n)});
            at += n;
          }
          wanted = b.place(std::move(p));
        }
      }
      b.tensor(label("t", i), shape, held, wanted, pick(2) ? DType::kBF16 : DType::kF32);
    }
    SCOPED_TRACE("trial " + std::to_string(trial));
    expect_same_as_explicit(b.job);
    if (HasFailure()) return;
  }
}

TEST(LayoutTest, TheCheckNamesTensorRangeAndRanks) {
  JobBuilder b(2, 1, 2);
  const std::vector<int64_t> shape = {8, 4};
  const uint32_t overlap = b.place({0, 0, {}, {{0, Region::slice(shape, 0, 0, 5)}, {1, Region::slice(shape, 0, 4, 4)}}});
  const uint32_t gap = b.place({0, 0, {}, {{0, Region::slice(shape, 0, 0, 3)}, {1, Region::slice(shape, 0, 5, 3)}}});
  b.tensor("overlapping", shape, overlap, b.tp_slice(0));
  b.tensor("gappy", shape, gap, b.place({0, 0, {}, {{2, Region::whole(shape)}}}));
  b.tensor("orphan", shape, kNobody, b.tp_slice(0));
  b.tensor("bad_segments", shape, b.fsdp(0), b.tp_slice(0, {3, 3}));
  b.tensor("both_sides", shape, b.fsdp(0), b.whole_on({1, 2}, 2));
  Status s = check_layout(b.job);
  ASSERT_FALSE(s.ok());
  const std::string msg = s.message();
  EXPECT_NE(msg.find("tensor 'overlapping' [8, 4]: trainer-0 holds [0:5, 0:4] and trainer-1 holds [4:8, 0:4]: "
                     "both claim [4:5, 0:4]"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("tensor 'gappy' [8, 4]: worker-0 wants [3:5, 0:4], which no rank holds"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tensor 'orphan' [8, 4] is wanted, and no rank holds it"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tensor 'bad_segments' [8, 4]: segments of 6 rows along dim 0, expected 8"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("tensor 'both_sides' [8, 4] (and every tensor placed alike): trainer-1 both holds and wants it"),
            std::string::npos)
      << msg;
  // The explicit planner names the same overlap and the same gap.
  b.job.tensors.resize(2);
  b.job.held.resize(2);
  b.job.wanted.resize(2);
  auto reference = plan_reshard(expand(b.job));
  ASSERT_FALSE(reference.ok());
  EXPECT_NE(reference.status().message().find("both claim [4:5, 0:4]"), std::string::npos);
  b.job.tensors.erase(b.job.tensors.begin());
  b.job.held.erase(b.job.held.begin());
  b.job.wanted.erase(b.job.wanted.begin());
  reference = plan_reshard(expand(b.job));
  ASSERT_FALSE(reference.ok());
  EXPECT_NE(reference.status().message().find("worker-0 wants [3:5, 0:4], which no rank holds"), std::string::npos)
      << reference.status().message();
}

// Explicit holders under rule wanters must cover the whole tensor (the
// wanters want all of it between them); segments that would wrap a sum are
// refused; explicit placements shared by many tensors are checked once.
TEST(LayoutTest, TheHolesAReviewFoundAreClosed) {
  JobBuilder b(1, 1, 1);
  const std::vector<int64_t> shape = {8, 4};
  b.tensor("partly_held", shape, b.place({0, 0, {}, {{0, Region::slice(shape, 0, 0, 3)}}}), b.whole_on({1}, 1));
  const int64_t big = std::numeric_limits<int64_t>::max();
  b.tensor("wrapping", {1}, b.place({b.mesh(1, 1, {0}), 0, {big, big, 3}, {}}), b.whole_on({1}, 1));
  const std::string msg = check_layout(b.job).message();
  EXPECT_NE(msg.find("tensor 'partly_held' [8, 4]: the wanters want [3:8, 0:4], which no rank holds"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("tensor 'wrapping' [1]: a segment of 9223372036854775807 rows after 0 along dim 0 of 1"),
            std::string::npos)
      << msg;
  JobBuilder negative(1, 1, 1);
  negative.tensor("negative_dim", shape, negative.place({negative.mesh(1, 1, {0}), -1, {}, {}}), kNobody);
  EXPECT_NE(check_layout(negative.job).message().find("placement #0: along dim -1 (0 to 7)"), std::string::npos)
      << check_layout(negative.job).message();
  // 4096 one-row boxes shared by 1000 tensors: checked once, not per tensor.
  JobBuilder many(1, 1, 1);
  Placement rows;
  for (int64_t r = 0; r < 4096; ++r) rows.boxes.push_back({0, Region::slice({4096, 1}, 0, r, 1)});
  const uint32_t held = many.place(std::move(rows)), wanted = many.whole_on({1}, 1);
  for (int i = 0; i < 1000; ++i) many.tensor(label("t", i), {4096, 1}, held, wanted);
  // Per tensor this was 8e9 intersections (tens of minutes: past the
  // test's timeout); once, a second or two.
  EXPECT_TRUE(check_layout(many.job).ok()) << check_layout(many.job).message();
}

TEST(LayoutTest, MalformedTablesAreRefusedNotTrusted) {
  JobBuilder b(2, 1, 1);
  b.tensor("a", {4}, 7, kNobody);
  EXPECT_NE(check_layout(b.job).message().find("tensor 'a' [4]: held by placement #7"), std::string::npos);
  JobBuilder c(2, 1, 1);
  c.job.meshes.push_back({2, 1, {0, 9}});
  c.job.placements.push_back({0, 0, {}, {}});
  c.tensor("a", {4}, 0, kNobody);
  EXPECT_NE(check_layout(c.job).message().find("mesh #0: rank 9 is not in the group of 3"), std::string::npos)
      << check_layout(c.job).message();
  JobBuilder d(2, 1, 1);
  d.job.meshes.push_back({2, 1, {0, 0}});
  d.job.placements.push_back({0, 0, {}, {}});
  d.tensor("a", {4}, 0, kNobody);
  EXPECT_NE(check_layout(d.job).message().find("mesh #0: trainer-0 appears twice"), std::string::npos);
  JobBuilder e(1, 1, 1);
  e.tensor("a", {4}, e.fsdp(0), kNobody);
  e.tensor("a", {4}, 0, kNobody);
  EXPECT_NE(check_layout(e.job).message().find("tensor 'a' is listed twice"), std::string::npos);
}

TEST(LayoutTest, SmallMovesOfAPairTravelTogetherAndLargeOnesAlone) {
  std::vector<Move> moves;
  for (uint32_t i = 0; i < 10; ++i) moves.push_back({100, i, 5, 0, 0, 0, 0, 0});
  moves.push_back({5000, 10, 5, 0, 0, 0, 0, 0});  // large: alone
  moves.push_back({100, 11, 5, 1, 0, 0, 0, 0});   // a forward: its own batch
  moves.push_back({100, 12, 6, 1, 0, 0, 0, 0});   // another peer
  const auto batches = pair_batches(moves, 450);
  ASSERT_EQ(batches.size(), 6u);
  EXPECT_EQ(batches[0].count, 4u);
  EXPECT_EQ(batches[0].bytes, 400u);
  EXPECT_EQ(batches[2].count, 2u);
  EXPECT_EQ(batches[3].count, 1u);
  EXPECT_EQ(batches[3].bytes, 5000u);
  EXPECT_EQ(batches[4].first, 11u);
  EXPECT_EQ(batches[5].first, 12u);
}

// DeepSeek-V3 on 256 FSDP2 ranks to 16 x TP=8 engines: 45,395 tensors, the
// whole table in one message under 8 MiB, decoded to the same job.
TEST(LayoutTest, AFrontierTableRoundTripsUnderTheMessageBound) {
  testing::FrontierJob built(testing::FrontierModel::kDeepSeekV3, testing::TrainerLayout::kExpertParallel, 256, 16);
  const JobLayout& job = built.job();
  ASSERT_EQ(job.tensors.size(), 45395u);
  ASSERT_TRUE(check_layout(job).ok()) << check_layout(job).message();
  const auto bytes = layout_bytes(job);
  EXPECT_LT(bytes.size(), 8u << 20);
  auto back = layout_from_bytes(bytes);
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->tensors, job.tensors);
  EXPECT_EQ(back->meshes, job.meshes);
  EXPECT_EQ(back->placements, job.placements);
  EXPECT_EQ(back->held, job.held);
  EXPECT_EQ(back->wanted, job.wanted);
  EXPECT_EQ(back->rank_names, job.rank_names);
}

TEST(LayoutTest, AHostileTableIsRefusedBeforeAnythingIsBuiltFromIt) {
  JobBuilder b(2, 1, 2);
  b.tensor("model.layers.0.weight", {8, 4}, b.fsdp(0), b.tp_slice(0));
  b.tensor("model.layers.1.weight", {8, 4}, b.fsdp(0), b.tp_slice(1));
  auto bytes = layout_bytes(b.job);
  ASSERT_TRUE(layout_from_bytes(bytes).ok());
  LayoutLimits tight;
  tight.max_tensors = 1;
  EXPECT_NE(layout_from_bytes(bytes, tight).status().message().find("2 tensors, more than 1"), std::string::npos);
  tight = {};
  tight.max_name_bytes = 8;
  EXPECT_NE(layout_from_bytes(bytes, tight).status().message().find("out of bounds"), std::string::npos);
  // A byte flipped in a name (the second's front-coded suffix "1.weight"):
  // the list no longer hashes to the digest it came with.
  const std::string suffix = "1.weight";
  auto at = std::search(bytes.begin(), bytes.end(), suffix.begin(), suffix.end());
  ASSERT_NE(at, bytes.end());
  auto forged = bytes;
  forged[static_cast<size_t>(at - bytes.begin()) + suffix.size() - 1] ^= 0x01;
  EXPECT_NE(layout_from_bytes(forged).status().message().find("does not hash to the digest"), std::string::npos)
      << layout_from_bytes(forged).status().message();
  // Truncated or misaligned frames.
  EXPECT_FALSE(layout_from_bytes(std::vector<uint8_t>(bytes.begin(), bytes.end() - 8)).ok());
  EXPECT_FALSE(layout_from_bytes(std::vector<uint8_t>(bytes.begin(), bytes.end() - 3)).ok());
}

// A cached plan is taken only for the same tensors, the same layout and the
// same rank; each change names itself and is planned again.
TEST(LayoutTest, ACachedPlanIsNeverReusedAcrossAChange) {
  auto make = []() {
    JobBuilder b(2, 2, 2);
    b.tensor("w", {8, 4}, b.fsdp(0), b.tp_slice(0));
    b.tensor("expert.0", {4, 4}, b.whole_on({0}, 1), b.on_ep_rank(0));
    b.tensor("expert.1", {4, 4}, b.whole_on({1}, 1), b.on_ep_rank(1));
    return b;
  };
  JobBuilder b = make();
  const auto bytes = layout_bytes(b.job);
  PlanCache cache;
  std::string why;
  EXPECT_EQ(cache.find(plan_key(b.job, bytes, 2), &why), nullptr);
  EXPECT_EQ(why, "no plan cached yet");
  const RankPlan& kept = cache.put(plan_key(b.job, bytes, 2), rank_plan(b.job, 2));
  EXPECT_EQ(cache.find(plan_key(b.job, layout_bytes(make().job), 2), &why), &kept);
  EXPECT_EQ(cache.find(plan_key(b.job, bytes, 3), &why), nullptr);
  EXPECT_NE(why.find("rank 2's, this is rank 3"), std::string::npos);
  JobBuilder reshaped = make();
  reshaped.job.tensors[0].shape = {16, 2};
  EXPECT_EQ(cache.find(plan_key(reshaped.job, layout_bytes(reshaped.job), 2), &why), nullptr);
  EXPECT_NE(why.find("the tensor list changed"), std::string::npos);
  JobBuilder moved = make();  // the EP map: expert 0 moves to EP rank 1
  std::swap(moved.job.wanted[1], moved.job.wanted[2]);
  EXPECT_EQ(cache.find(plan_key(moved.job, layout_bytes(moved.job), 2), &why), nullptr);
  EXPECT_NE(why.find("the layout changed"), std::string::npos);
  JobBuilder renamed = make();  // a rank replaced by another member
  renamed.job.rank_names[3] = "worker-9";
  EXPECT_EQ(cache.find(plan_key(renamed.job, layout_bytes(renamed.job), 2), &why), nullptr);
  EXPECT_NE(why.find("the layout changed"), std::string::npos);
  // The plan after the EP move differs: reusing the cached one would be wrong.
  EXPECT_NE(rank_plan(moved.job, 2).receives, kept.receives);
}

}  // namespace
}  // namespace paramcast::reshard
