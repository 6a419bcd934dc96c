// The many-sender plan (common/reshard/): regions, holdings x wants ->
// transfers, the whole-plan checks that name tensor, range and ranks, and
// the round schedule. Pure: no process, no socket.
#include "common/reshard/reshard_plan.h"

#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <set>

#include "common/reshard/schedule.h"
#include "common/reshard/sharded_update.h"
#include "tests/support/sanitizer.h"

namespace paramcast::reshard {
namespace {

TensorSpec spec(const std::string& name, std::vector<int64_t> shape, DType d = DType::kBF16) {
  return TensorSpec{name, d, std::move(shape)};
}

RankManifest rank(int r, const std::string& name, std::vector<TensorSpec> tensors) {
  RankManifest m;
  m.rank = r;
  m.name = name;
  m.tensors = std::move(tensors);
  return m;
}

// FSDP2's Shard(0) of `rows` rows over `world` ranks: torch.chunk's split
// (ceil-sized shards, the last one short or empty).
Region fsdp_shard(const std::vector<int64_t>& shape, int world, int r) {
  const int64_t rows = shape[0], per = (rows + world - 1) / world;
  const int64_t start = std::min<int64_t>(rows, per * r);
  return Region::slice(shape, 0, start, std::min<int64_t>(per, rows - start));
}

// "trainer-3": built with += (GCC 12 reports a bogus -Wrestrict inside
// operator+ of a literal and a temporary string, GCC bug 105329).
std::string label(const char* prefix, int i) {
  std::string s = prefix;
  s += std::to_string(i);
  return s;
}

uint64_t received_by(const ReshardPlan& p, int r) { return p.received.count(r) ? p.received.at(r) : 0; }
uint64_t sent_by(const ReshardPlan& p, int r) { return p.sent.count(r) ? p.sent.at(r) : 0; }

TEST(RegionTest, IntersectSubtractAndBounds) {
  const std::vector<int64_t> shape = {10, 8};
  Region a = Region::slice(shape, 0, 2, 5);  // rows 2..7
  Region b = Region::slice(shape, 1, 4, 4);  // cols 4..8
  auto c = intersect(a, b);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->to_string(), "[2:7, 4:8]");
  EXPECT_EQ(c->elements(), 20u);
  EXPECT_FALSE(intersect(Region::slice(shape, 0, 0, 2), a));
  auto rest = subtract(a, b);
  uint64_t n = 0;
  for (const auto& r : rest) {
    n += r.elements();
    EXPECT_FALSE(intersect(r, b)) << r.to_string();
  }
  EXPECT_EQ(n, a.elements() - c->elements());
  EXPECT_TRUE(a.inside(shape));
  EXPECT_FALSE(Region::slice(shape, 0, 8, 3).inside(shape));
  EXPECT_FALSE(Region::whole({10}).inside(shape));
  EXPECT_TRUE(a.contiguous_in(shape));
  EXPECT_FALSE(b.contiguous_in(shape));
}

// contains(box, inner) says what intersect(box, inner) == inner says, over
// random boxes of rank 0-3 (empty ones and scalars included).
TEST(RegionTest, ContainsAgreesWithIntersect) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int64_t> at(0, 6), len(0, 4);
  for (int i = 0; i < 20000; ++i) {
    const size_t rank = static_cast<size_t>(i % 4);
    Region box, inner;
    for (size_t d = 0; d < rank; ++d) {
      box.offsets.push_back(at(rng));
      box.lengths.push_back(len(rng));
      inner.offsets.push_back(at(rng));
      inner.lengths.push_back(len(rng));
    }
    const auto common = intersect(box, inner);
    EXPECT_EQ(contains(box, inner), common && *common == inner) << box.to_string() << " " << inner.to_string();
  }
  EXPECT_FALSE(contains(Region::whole({4, 4}), Region::whole({4})));
}

// A region whose offsets and lengths disagree in rank is refused with words,
// never read past its end.
TEST(RegionTest, AMalformedRegionIsRefusedNotRead) {
  Region bad{{0}, {6, 4}};
  EXPECT_EQ(bad.to_string(), "(1 offsets, 2 lengths)");
  EXPECT_FALSE(bad.inside({6, 4}));
  RankManifest a = rank(0, "trainer-0", {spec("w", {6, 4})});
  a.holds.push_back({"w", bad});
  RankManifest e = rank(1, "worker-1", {spec("w", {6, 4})});
  e.wants.push_back({"w", Region::whole({6, 4})});
  auto plan = plan_reshard({a, e});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("trainer-0 holds (1 offsets, 2 lengths), outside it"), std::string::npos)
      << plan.status().message();
}

// A region whose end does not fit in 64 bits (a hostile Wants or Holdings)
// is said as it came, without computing its end (signed overflow: the
// sanitizer build aborts on it), and refused.
TEST(RegionTest, ARegionPastTheLargestIndexIsSaidAndRefused) {
  const int64_t most = std::numeric_limits<int64_t>::max();
  Region far{{most, 0}, {1, 4}};
  EXPECT_EQ(far.to_string(), "[" + std::to_string(most) + "+1, 0:4]");
  EXPECT_FALSE(far.inside({6, 4}));
  RankManifest a = rank(0, "trainer-0", {spec("w", {6, 4})});
  a.holds.push_back({"w", Region::whole({6, 4})});
  RankManifest e = rank(1, "worker-1", {spec("w", {6, 4})});
  e.wants.push_back({"w", far});
  auto plan = plan_reshard({a, e});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("worker-1 wants [" + std::to_string(most) + "+1, 0:4], outside it"),
            std::string::npos)
      << plan.status().message();
}

// FSDP2 on 4 ranks, uneven last shard, to 2 engines that want whole
// tensors: each shard leaves its rank once and is forwarded between the
// engines; every engine gets every element exactly once.
TEST(ReshardPlanTest, FsdpShardsReachWholeTensorEnginesEachSentOnce) {
  const std::vector<TensorSpec> model = {spec("embed", {1001, 64}), spec("norm", {64}, DType::kF32),
                                         spec("proj", {130, 64})};
  std::vector<RankManifest> ranks;
  for (int r = 0; r < 4; ++r) {
    auto m = rank(r, label("trainer-", r), model);
    for (const auto& t : model)
      if (t.shape.size() == 2) m.holds.push_back({t.name, fsdp_shard(t.shape, 4, r)});
      else m.holds.push_back({t.name, Region::whole(t.shape)});  // a replicated norm
    ranks.push_back(m);
  }
  uint64_t model_bytes = 0;
  for (const auto& t : model) model_bytes += t.nbytes().value();
  for (int e = 0; e < 2; ++e) {
    auto m = rank(4 + e, label("worker-", e + 1), model);
    for (const auto& t : model) m.wants.push_back({t.name, Region::whole(t.shape)});
    ranks.push_back(m);
  }
  auto plan = plan_reshard(ranks);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_TRUE(validate_plan(*plan, ranks).ok());
  EXPECT_EQ(received_by(*plan, 4), model_bytes);
  EXPECT_EQ(received_by(*plan, 5), model_bytes);
  // Each trainer rank sends its shard once (plus a share of the norm), never
  // the whole model; together exactly one model's bytes leave the trainer.
  uint64_t from_trainer = 0;
  for (int r = 0; r < 4; ++r) {
    EXPECT_LT(sent_by(*plan, r), model_bytes / 3) << r;
    from_trainer += sent_by(*plan, r);
  }
  EXPECT_EQ(from_trainer, model_bytes);
  // Forwarding spreads over the two engines.
  EXPECT_GT(sent_by(*plan, 4), 0u);
  EXPECT_GT(sent_by(*plan, 5), 0u);
  EXPECT_EQ(plan->busiest_bytes(), model_bytes);  // each engine's inbound link: the limit
  EXPECT_EQ(plan->least_busiest_bytes, model_bytes);
  // Without forwarding each shard leaves its rank once per engine.
  auto direct = plan_reshard(ranks, ReshardOptions{false});
  ASSERT_TRUE(direct.ok());
  EXPECT_EQ(sent_by(*direct, 4), 0u);
  uint64_t direct_from_trainer = 0;
  for (int r = 0; r < 4; ++r) direct_from_trainer += sent_by(*direct, r);
  EXPECT_EQ(direct_from_trainer, 2 * model_bytes);
}

// A tensor every rank holds whole: the plan spreads the sending over the
// replicas instead of taking all of it from one.
TEST(ReshardPlanTest, ReplicatedTensorsAreSpreadOverTheirHolders) {
  std::vector<TensorSpec> model;
  for (int i = 0; i < 40; ++i) model.push_back(spec(label("w", i), {64, 64}));
  std::vector<RankManifest> ranks;
  for (int r = 0; r < 4; ++r) {
    auto m = rank(r, label("trainer-", r), model);
    for (const auto& t : model) m.holds.push_back({t.name, Region::whole(t.shape)});
    ranks.push_back(m);
  }
  auto e = rank(4, "worker-1", model);
  for (const auto& t : model) e.wants.push_back({t.name, Region::whole(t.shape)});
  ranks.push_back(e);
  auto plan = plan_reshard(ranks);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  for (int r = 0; r < 4; ++r) EXPECT_EQ(sent_by(*plan, r), 10u * 64 * 64 * 2) << "trainer-" << r;
}

// Pipeline stages: each rank holds only its layers; the others are absent
// from its manifest. Tensor-parallel engines: 2 replicas x TP=2 want their
// slices of a column-parallel (dim 0) and a row-parallel (dim 1) weight and
// the whole norm; each engine rank receives its slices and nothing more,
// and rank t of one replica forwards to rank t of the other.
TEST(ReshardPlanTest, PipelineStagesToTensorParallelSlices) {
  const TensorSpec q = spec("layers.0.q", {128, 64}), o = spec("layers.1.o", {64, 128}), n = spec("norm", {64});
  std::vector<RankManifest> ranks;
  auto s0 = rank(0, "trainer-0", {q});
  s0.holds.push_back({q.name, Region::whole(q.shape)});
  auto s1 = rank(1, "trainer-1", {o, n});
  s1.holds.push_back({o.name, Region::whole(o.shape)});
  s1.holds.push_back({n.name, Region::whole(n.shape)});
  ranks = {s0, s1};
  for (int replica = 0; replica < 2; ++replica)
    for (int tp = 0; tp < 2; ++tp) {
      auto m = rank(2 + replica * 2 + tp, label("worker-", replica * 2 + tp), {q, o, n});
      m.wants.push_back({q.name, Region::slice(q.shape, 0, tp * 64, 64)});
      m.wants.push_back({o.name, Region::slice(o.shape, 1, tp * 64, 64)});
      m.wants.push_back({n.name, Region::whole(n.shape)});
      ranks.push_back(m);
    }
  auto plan = plan_reshard(ranks);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const uint64_t slice_bytes = (64 * 64 + 64 * 64) * 2 + 64 * 2;
  for (int r = 2; r < 6; ++r) EXPECT_EQ(received_by(*plan, r), slice_bytes) << r;
  // Each trainer rank sends each of its slices once: its tensors' bytes.
  EXPECT_EQ(sent_by(*plan, 0), q.nbytes().value());
  EXPECT_EQ(sent_by(*plan, 1), o.nbytes().value() + n.nbytes().value());
  for (const auto& x : plan->transfers)
    if (x.after >= 0 && plan->tensors[x.tensor].name != n.name) {  // the whole norm goes to all four
      EXPECT_EQ((x.from - 2) % 2, (x.to - 2) % 2) << "a slice is forwarded between the same TP rank only";
    }
}

// Two ranks that claim the same rows, and rows nobody holds: refused before
// anything moves, naming tensor, range and both ranks.
TEST(ReshardPlanTest, OverlapsAndGapsAreRefusedNamingTensorRangeAndRanks) {
  const TensorSpec w = spec("w", {100, 8});
  auto a = rank(0, "trainer-0", {w});
  a.holds.push_back({w.name, Region::slice(w.shape, 0, 0, 60)});
  auto b = rank(1, "trainer-1", {w});
  b.holds.push_back({w.name, Region::slice(w.shape, 0, 40, 40)});  // rows 40..80: overlap 40..60, gap 80..100
  auto e = rank(2, "worker-1", {w});
  e.wants.push_back({w.name, Region::whole(w.shape)});
  auto plan = plan_reshard({a, b, e});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), Code::kInvalidArgument);
  EXPECT_NE(plan.status().message().find(
                "tensor 'w': trainer-0 holds [0:60, 0:8] and trainer-1 holds [40:80, 0:8]: both claim [40:60, 0:8]"),
            std::string::npos)
      << plan.status().message();
  b.holds[0].region = Region::slice(w.shape, 0, 60, 20);  // no overlap now; rows 80..100 nobody holds
  plan = plan_reshard({a, b, e});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("tensor 'w': worker-1 wants [80:100, 0:8], which no rank holds"),
            std::string::npos)
      << plan.status().message();
}

// A rank that states one tensor twice (a spec each, a row each) is refused,
// named; before, the two merged and the per-tensor region bound of the
// caller, counted per stated entry, never saw more than one region.
TEST(ReshardPlanTest, ATensorStatedTwiceByOneRankIsRefused) {
  const TensorSpec w = spec("w", {4, 8});
  auto a = rank(0, "trainer-0", {w, w});
  a.holds.push_back({w.name, Region::slice(w.shape, 0, 0, 2)});
  a.holds.push_back({w.name, Region::slice(w.shape, 0, 2, 2)});
  auto e = rank(1, "worker-1", {w});
  e.wants.push_back({w.name, Region::whole(w.shape)});
  auto plan = plan_reshard({a, e});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("tensor 'w': trainer-0 states its spec twice"), std::string::npos)
      << plan.status().message();
}

// The checks look each tensor up by name: a model of many small tensors (a
// mixture of experts has tens of thousands) costs n log n, not n squared.
// 100,000 tensors, one holder, two engines wanting each whole: the
// quadratic checks this replaced (a scan of the manifest per holding, per
// want, per transfer) would take many minutes here, past the test's bound.
TEST(ReshardPlanTest, ManyTensorsArePlannedWithoutScanningTheManifestPerTensor) {
  // Under a sanitizer a fifth of them: the same paths (n squared would still be 4e8 lookups).
  constexpr int kTensors = test::kSanitized ? 20000 : 100000;
  auto a = rank(0, "trainer-0", {});
  auto e1 = rank(1, "worker-1", {});
  auto e2 = rank(2, "worker-2", {});
  for (int i = 0; i < kTensors; ++i) {
    const TensorSpec t = spec(label("t", i), {1});
    for (auto* r : {&a, &e1, &e2}) r->tensors.push_back(t);
    a.holds.push_back({t.name, Region::whole(t.shape)});
    e1.wants.push_back({t.name, Region::whole(t.shape)});
    e2.wants.push_back({t.name, Region::whole(t.shape)});
  }
  auto plan = plan_reshard({a, e1, e2});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->tensors.size(), static_cast<size_t>(kTensors));
  EXPECT_EQ(received_by(*plan, 1), 2u * kTensors);
  EXPECT_EQ(received_by(*plan, 2), 2u * kTensors);
  EXPECT_EQ(sent_by(*plan, 0) + sent_by(*plan, 1) + sent_by(*plan, 2), 4u * kTensors);
}

// Replicas (two data-parallel ranks holding the same rows) that gave
// digests of them: equal, the plan spreads the pieces over both; different
// (a stale replica), refused before anything moves, naming both and the
// range. A rank that gave no digest is not compared.
TEST(ReshardPlanTest, ReplicasWithDifferentBytesAreRefusedNamingBoth) {
  const TensorSpec w = spec("w", {8, 4});
  auto a = rank(0, "trainer-0", {w});
  a.holds.push_back({w.name, Region::whole(w.shape)});
  a.digests[0] = 0x1111;
  auto b = rank(1, "trainer-1", {w});
  b.holds.push_back({w.name, Region::whole(w.shape)});
  b.digests[0] = 0x1111;
  auto e = rank(2, "worker-1", {w});
  e.wants.push_back({w.name, Region::whole(w.shape)});
  ASSERT_TRUE(plan_reshard({a, b, e}).ok());
  b.digests[0] = 0x2222;
  auto plan = plan_reshard({a, b, e});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("tensor 'w': trainer-0 and trainer-1 hold [0:8, 0:4] with different bytes "
                                         "(xxh64 0000000000001111 and 0000000000002222)"),
            std::string::npos)
      << plan.status().message();
  b.digests.clear();
  EXPECT_TRUE(plan_reshard({a, b, e}).ok());
}

TEST(ReshardPlanTest, DisagreementsAndBadRegionsAreNamed) {
  auto a = rank(0, "trainer-0", {spec("w", {10, 8})});
  a.holds.push_back({"w", Region::whole({10, 8})});
  auto b = rank(1, "worker-1", {spec("w", {10, 9})});
  b.wants.push_back({"w", Region::whole({10, 9})});
  auto plan = plan_reshard({a, b});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("tensor 'w': BF16 [10, 8] at trainer-0, BF16 [10, 9] at worker-1"),
            std::string::npos)
      << plan.status().message();
  b = rank(1, "worker-1", {spec("w", {10, 8}, DType::kF32)});
  b.wants.push_back({"w", Region::whole({10, 8})});
  plan = plan_reshard({a, b});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("F32"), std::string::npos) << plan.status().message();
  // Outside the tensor; overlapping wants of one rank; a tensor without a spec.
  b = rank(1, "worker-1", {spec("w", {10, 8})});
  b.wants.push_back({"w", Region::slice({10, 8}, 0, 8, 4)});
  plan = plan_reshard({a, b});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("worker-1 wants [8:12, 0:8], outside it"), std::string::npos)
      << plan.status().message();
  b.wants = {{"w", Region::slice({10, 8}, 0, 0, 6)}, {"w", Region::slice({10, 8}, 0, 4, 6)}};
  plan = plan_reshard({a, b});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("worker-1 wants [0:6, 0:8] and [4:10, 0:8], which overlap at [4:6, 0:8]"),
            std::string::npos)
      << plan.status().message();
  b.wants = {{"v", Region::whole({3})}};
  plan = plan_reshard({a, b});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("worker-1 wants 'v' without stating its spec"), std::string::npos)
      << plan.status().message();
}

// validate_plan catches a plan that delivers twice, misses bytes, or sends
// what its sender does not have.
TEST(ReshardPlanTest, ValidateCatchesEveryKindOfBadPlan) {
  const TensorSpec w = spec("w", {16, 4});
  auto a = rank(0, "trainer-0", {w});
  a.holds.push_back({w.name, Region::slice(w.shape, 0, 0, 8)});
  auto b = rank(1, "trainer-1", {w});
  b.holds.push_back({w.name, Region::slice(w.shape, 0, 8, 8)});
  auto e = rank(2, "worker-1", {w});
  e.wants.push_back({w.name, Region::whole(w.shape)});
  const std::vector<RankManifest> ranks = {a, b, e};
  auto plan = plan_reshard(ranks);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->transfers.size(), 2u);
  ReshardPlan twice = *plan;
  twice.transfers.push_back(twice.transfers[0]);
  EXPECT_NE(validate_plan(twice, ranks).message().find("twice"), std::string::npos);
  ReshardPlan short_of = *plan;
  short_of.transfers.pop_back();
  EXPECT_NE(validate_plan(short_of, ranks).message().find("gets 32 of the 64 elements"), std::string::npos)
      << validate_plan(short_of, ranks).message();
  ReshardPlan wrong = *plan;
  std::swap(wrong.transfers[0].from, wrong.transfers[1].from);
  EXPECT_NE(validate_plan(wrong, ranks).message().find("does not have 'w'"), std::string::npos);
}

// Random shardings (FSDP rows, Megatron columns, replicas, pipeline stages)
// to random engines (whole tensors, row or column slices, replicas of
// slices): every plan delivers every wanted element exactly once, no rank
// sends twice what it holds without forwarding, and the round schedule has
// no rank on two transfers of one round and every forward after its source.
TEST(ReshardPlanTest, RandomLayoutsArePlannedExactlyAndScheduledWithoutContention) {
  std::mt19937 rng(11);
  for (int round = 0; round < 150; ++round) {
    const int senders = 1 + static_cast<int>(rng() % 4), replicas = 1 + static_cast<int>(rng() % 3);
    const int tp = 1 + static_cast<int>(rng() % 3);
    std::vector<TensorSpec> model;
    const int tensors = 1 + static_cast<int>(rng() % 6);
    for (int t = 0; t < tensors; ++t)
      model.push_back(spec(label("t", t), {1 + static_cast<int64_t>(rng() % 40), 1 + static_cast<int64_t>(rng() % 12)}));
    std::vector<RankManifest> ranks;
    for (int s = 0; s < senders; ++s) ranks.push_back(rank(s, label("trainer-", s), model));
    for (const auto& t : model) {
      switch (rng() % 3) {
        case 0:  // FSDP rows, uneven
          for (int s = 0; s < senders; ++s) {
            Region r = fsdp_shard(t.shape, senders, s);
            if (!r.empty()) ranks[static_cast<size_t>(s)].holds.push_back({t.name, r});
          }
          break;
        case 1:  // replicated on every rank
          for (int s = 0; s < senders; ++s) ranks[static_cast<size_t>(s)].holds.push_back({t.name, Region::whole(t.shape)});
          break;
        default:  // one pipeline stage holds it
          ranks[rng() % static_cast<size_t>(senders)].holds.push_back({t.name, Region::whole(t.shape)});
      }
    }
    for (int rep = 0; rep < replicas; ++rep)
      for (int k = 0; k < tp; ++k) {
        auto m = rank(senders + rep * tp + k, label("worker-", rep * tp + k), model);
        for (const auto& t : model) {
          const int dim = static_cast<int>(rng() % 2);
          const int64_t n = t.shape[static_cast<size_t>(dim)], per = (n + tp - 1) / tp;
          const int64_t start = std::min<int64_t>(n, per * k), len = std::min<int64_t>(per, n - start);
          if (tp > 1 && len > 0) m.wants.push_back({t.name, Region::slice(t.shape, dim, start, len)});
          else if (tp == 1) m.wants.push_back({t.name, Region::whole(t.shape)});
        }
        ranks.push_back(m);
      }
    for (bool forward : {true, false}) {
      auto plan = plan_reshard(ranks, ReshardOptions{forward});
      ASSERT_TRUE(plan.ok()) << "round " << round << ": " << plan.status().to_string();
      ASSERT_TRUE(validate_plan(*plan, ranks).ok()) << validate_plan(*plan, ranks).to_string();
      EXPECT_GE(plan->busiest_bytes(), plan->least_busiest_bytes);
      // A rank that follows a checked plan (a member of a sharded update)
      // plans without the self-check, and gets the same transfers.
      auto followed = plan_reshard(ranks, ReshardOptions{.forward = forward, .validate = false});
      ASSERT_TRUE(followed.ok()) << followed.status().to_string();
      ASSERT_EQ(followed->transfers.size(), plan->transfers.size());
      for (size_t i = 0; i < plan->transfers.size(); ++i) {
        const Transfer &a = plan->transfers[i], &b = followed->transfers[i];
        EXPECT_TRUE(a.from == b.from && a.to == b.to && a.tensor == b.tensor && a.region == b.region &&
                    a.bytes == b.bytes && a.after == b.after)
            << "transfer " << i;
      }
      auto rounds = schedule_rounds(*plan);
      std::vector<size_t> round_of(plan->transfers.size(), SIZE_MAX);
      for (size_t r = 0; r < rounds.size(); ++r) {
        std::set<int> from, to;
        for (size_t i : rounds[r].transfers) {
          EXPECT_TRUE(from.insert(plan->transfers[i].from).second) << "a rank sends twice in round " << r;
          EXPECT_TRUE(to.insert(plan->transfers[i].to).second) << "a rank receives twice in round " << r;
          round_of[i] = r;
        }
      }
      for (size_t i = 0; i < plan->transfers.size(); ++i) {
        ASSERT_NE(round_of[i], SIZE_MAX) << "transfer " << i << " not scheduled";
        if (plan->transfers[i].after >= 0) {
          EXPECT_GT(round_of[i], round_of[static_cast<size_t>(plan->transfers[i].after)]);
        }
      }
      // A rank's transfers are in rounds of their own: the rounds last at
      // least as long as its link is busy.
      EXPECT_GE(schedule_bytes(rounds), plan->busiest_bytes());
    }
  }
}

}  // namespace
}  // namespace paramcast::reshard

namespace paramcast::reshard {
namespace {

// Two trainer ranks each holding half the rows of `w`, and (rank 2) an
// engine that wants it whole; with `replica`, rank 3 holds rank 1's rows too.
UpdatePlan two_rank_plan(uint64_t version, bool replica = false) {
  UpdatePlan p;
  p.version = version;
  p.sharded = true;
  p.tensors = {TensorSpec{"w", DType::kF32, {8, 4}}};
  auto hold = [&](int rank, int64_t row, uint64_t digest) {
    UpdatePlan::Holding h;
    h.rank = rank;
    h.tensor = 0;
    h.offsets = {row, 0};
    h.lengths = {4, 4};
    h.seq = version;  // changes every call: not part of the shape
    h.digest = digest;
    p.holders.push_back(h);
  };
  hold(0, 0, 100 + version);
  hold(1, 4, 200 + version);
  if (replica) hold(3, 4, 200 + version);
  return p;
}

// The same shape twice: the second update takes the first's moves without
// planning; a change of regions, ranks or names plans again; a cached plan
// still refuses replicas whose digests differ.
TEST(ShardedMovesCacheTest, TheSameShapeReusesItsMovesAndAnyChangePlansAgain) {
  ShardedMovesCache cache;
  const std::vector<std::string> names = {"publisher", "trainer-1", "worker-1", "trainer-2"};
  auto first = cache.moves(two_rank_plan(1), 3, names);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  EXPECT_FALSE(cache.last_was_cached());
  auto second = cache.moves(two_rank_plan(2), 3, names);
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(cache.last_was_cached());
  EXPECT_EQ(second->get(), first->get());
  UpdatePlan moved = two_rank_plan(3);
  moved.holders[0].lengths = {5, 4};  // rank 0 now holds rows 0..4: an overlap, refused afresh
  moved.holders[1].offsets = {5, 0};
  moved.holders[1].lengths = {3, 4};
  auto replanned = cache.moves(moved, 3, names);
  ASSERT_TRUE(replanned.ok());
  EXPECT_FALSE(cache.last_was_cached());
  EXPECT_NE(replanned->get(), first->get());
  auto renamed = cache.moves(moved, 3, {"publisher", "trainer-1", "worker-9"});
  ASSERT_TRUE(renamed.ok());
  EXPECT_FALSE(cache.last_was_cached());
  // Replicas: cached, then their digests disagree: refused naming both.
  ASSERT_TRUE(cache.moves(two_rank_plan(4, true), 4, names).ok());
  UpdatePlan stale = two_rank_plan(5, true);
  stale.holders[2].digest = 7;
  auto refused = cache.moves(stale, 4, names);
  EXPECT_TRUE(cache.last_was_cached());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("trainer-1 and trainer-2 hold [4:8, 0:4] with different bytes"),
            std::string::npos)
      << refused.status().message();
  // A plan refused on its own keeps nothing: the next one plans afresh.
  UpdatePlan gap = two_rank_plan(6);
  gap.holders.pop_back();
  EXPECT_FALSE(cache.moves(gap, 3, names).ok());
  ASSERT_TRUE(cache.moves(two_rank_plan(7), 3, names).ok());
  EXPECT_FALSE(cache.last_was_cached());
}

// A member tells the cache which object holds its plan's shape (its kept
// whole plan, which a plan by reference copies): the same object under the
// same ranks and names takes the kept moves without building the shape;
// another object, even of the same digest, or other names, compares (or
// plans) as before; an object learnt by comparison serves the next.
TEST(ShardedMovesCacheTest, AKnownShapeTakesTheKeptMovesOnlyAsTheSameObjectUnderTheSameRanksAndNames) {
  ShardedMovesCache cache;
  const std::vector<std::string> names = {"publisher", "trainer-1", "worker-1"};
  const auto kept = std::make_shared<const UpdatePlan>(two_rank_plan(1));
  auto first = cache.moves(*kept, 3, names, {false, kept});
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  EXPECT_FALSE(cache.last_was_cached());
  auto second = cache.moves(two_rank_plan(2), 3, names, {false, kept});
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(cache.last_was_cached());
  EXPECT_EQ(second->get(), first->get());
  // Other names for the same object: compared, and planned again.
  auto renamed = cache.moves(two_rank_plan(3), 3, {"publisher", "trainer-1", "worker-9"}, {false, kept});
  ASSERT_TRUE(renamed.ok());
  EXPECT_FALSE(cache.last_was_cached());
  EXPECT_NE(renamed->get(), first->get());
  // Another object whose shape differs: compared, and planned again; the
  // same object after it names its moves, not the first's.
  auto moved = std::make_shared<UpdatePlan>(two_rank_plan(4));
  moved->holders[0].lengths = {5, 4};
  moved->holders[1].offsets = {5, 0};
  moved->holders[1].lengths = {3, 4};
  auto replanned = cache.moves(*moved, 3, names, {false, moved});
  ASSERT_TRUE(replanned.ok());
  EXPECT_FALSE(cache.last_was_cached());
  // A new object of the same bytes: compared, cached, and then known.
  const auto again = std::make_shared<const UpdatePlan>(*moved);
  ASSERT_TRUE(cache.moves(*again, 3, names, {false, again}).ok());
  EXPECT_TRUE(cache.last_was_cached());
  auto by_object = cache.moves(*again, 3, names, {false, again});
  ASSERT_TRUE(by_object.ok());
  EXPECT_TRUE(cache.last_was_cached());
  EXPECT_EQ(by_object->get(), replanned->get());
  // The first object again (its shape no longer the kept moves'): compared, planned.
  ASSERT_TRUE(cache.moves(*kept, 3, names, {false, kept}).ok());
  EXPECT_FALSE(cache.last_was_cached());
}

}  // namespace
}  // namespace paramcast::reshard
