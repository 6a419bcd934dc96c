#include "common/plan.h"
#include "common/plan_proto.h"

#include <capnp/message.h>
#include <gtest/gtest.h>

namespace paramcast {
namespace {

DataPlaneOptions opts(uint64_t bucket, uint64_t direct) {
  DataPlaneOptions o;
  o.bucket_bytes = bucket;
  o.direct_min_bytes = direct;
  return o;
}

uint64_t covered(const UpdatePlan& p, uint32_t tensor) {
  uint64_t n = 0;
  for (auto& b : p.buckets)
    for (auto& piece : b.pieces)
      if (piece.tensor == tensor) n += piece.length;
  return n;
}

TEST(PlanTest, PacksSmallSendsLargeDirectAndSplitsHuge) {
  std::vector<TensorSpec> t = {
      {"small_a", DType::kF32, {10}},     // 40 B, packed
      {"empty", DType::kF32, {0}},        // 0 B, packed
      {"large", DType::kU8, {5000}},      // > bucket: 2 direct chunks
      {"small_b", DType::kI8, {3}},       // packed, 256-aligned
      {"huge", DType::kU8, {10000}},      // > bucket: 3 direct chunks
  };
  auto p = build_plan(7, t, opts(4096, 1024));
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->total_bytes, 40u + 5000 + 3 + 10000);
  for (uint32_t i = 0; i < t.size(); ++i) EXPECT_EQ(covered(*p, i), p->nbytes[i]) << t[i].name;
  int direct = 0;
  for (auto& b : p->buckets) {
    EXPECT_LE(b.bytes, 4096u);
    if (b.direct) {
      ++direct;
      ASSERT_EQ(b.pieces.size(), 1u);
      EXPECT_EQ(b.pieces[0].length, b.bytes);
    }
    for (auto& piece : b.pieces)
      if (!b.direct) {
        EXPECT_EQ(piece.bucket_offset % kPackAlignment, 0u);
      }
  }
  EXPECT_EQ(direct, 2 + 3);  // "large" (5000 B) and "huge" both exceed the 4096 B bucket
  uint64_t packed = 0;
  for (auto& b : p->buckets)
    if (!b.direct) packed = std::max(packed, b.bytes);
  EXPECT_EQ(packed, 256u + 3);  // small_a at 0, empty, small_b at the next 256-byte boundary
}

TEST(PlanTest, RejectsDuplicateAndEmptyNames) {
  auto dup = build_plan(1, {{"w", DType::kF32, {1}}, {"w", DType::kF32, {1}}}, opts(4096, 1024));
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find("'w' appears twice"), std::string::npos);
  EXPECT_FALSE(build_plan(1, {{"", DType::kF32, {1}}}, opts(4096, 1024)).ok());
}

TEST(PlanTest, ProtoRoundTripAndCrossChecks) {
  std::vector<TensorSpec> t;
  for (int i = 0; i < 100; ++i) {
    // Built with += rather than "t" + std::to_string(i): GCC 12 at -O2/-O3
    // reports a bogus -Wrestrict inside that operator+ (GCC bug 105329).
    std::string name = "t";
    name += std::to_string(i);
    t.push_back({name, DType::kBF16, {i, 3}});
  }
  auto p = build_plan(3, t, opts(8192, 2048));
  ASSERT_TRUE(p.ok());
  capnp::MallocMessageBuilder b;
  plan_to_proto(*p, b.initRoot<proto::Plan>());
  auto back = plan_from_proto(b.getRoot<proto::Plan>().asReader());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->tensors, p->tensors);
  EXPECT_EQ(back->manifest_hash, p->manifest_hash);
  EXPECT_EQ(back->buckets.size(), p->buckets.size());

  // A piece pointing past its tensor is refused with the tensor's name.
  b.getRoot<proto::Plan>().getBuckets()[0].getPieces()[1].setLength(1 << 20);
  auto bad = plan_from_proto(b.getRoot<proto::Plan>().asReader());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Code::kProtocol);
  EXPECT_NE(bad.status().message().find("'t1'"), std::string::npos) << bad.status().message();
}

// A sharded plan of two tensors, held in halves by ranks 0 and 1 (their
// calls' seqs 3 and 4).
UpdatePlan sharded_plan(uint64_t version) {
  auto p = build_plan(version, {{"a", DType::kF32, {4, 2}}, {"b", DType::kBF16, {6}}}, opts(8192, 2048));
  EXPECT_TRUE(p.ok());
  p->buckets.clear();
  p->sharded = true;
  p->holders = {{0, 0, {0, 0}, {2, 2}, 3, std::nullopt}, {0, 1, {0}, {3}, 3, std::nullopt},
                {1, 0, {2, 0}, {2, 2}, 4, std::nullopt}, {1, 1, {3}, {3}, 4, std::nullopt}};
  return std::move(p.value());
}

// A plan by reference (Plan.shapeRef) carries the version and the ranks'
// seqs; read against the member's kept plan of that digest it is that
// plan's tensors with this update's version and seqs (the regions are read
// in the kept plan), and anything that disagrees with it is refused.
TEST(PlanTest, APlanByReferenceIsTheKeptPlanWithThisUpdatesVersionAndSeqs) {
  const UpdatePlan first = sharded_plan(1);
  capnp::MallocMessageBuilder whole;
  plan_to_proto(first, whole.initRoot<proto::Plan>());
  auto kept = plan_from_proto(whole.getRoot<proto::Plan>().asReader());
  ASSERT_TRUE(kept.ok()) << kept.status().to_string();
  const uint64_t digest = sharded_shape_digest(*kept);
  EXPECT_EQ(digest, sharded_shape_digest(first));  // the member's digest of what it got is the publisher's

  UpdatePlan next = sharded_plan(2);
  for (auto& h : next.holders) h.seq += 10;
  capnp::MallocMessageBuilder ref;
  plan_to_proto(next, ref.initRoot<proto::Plan>(), digest);
  auto r = ref.getRoot<proto::Plan>();
  EXPECT_EQ(r.getTensors().size(), 0u);
  EXPECT_EQ(r.getHolders().size(), 2u);
  EXPECT_EQ(r.getHolders()[0].getHolds().size(), 0u);
  auto read = plan_by_reference(r.asReader(), *kept);
  ASSERT_TRUE(read.ok()) << read.status().to_string();
  EXPECT_EQ(read->version, 2u);
  EXPECT_EQ(read->tensors, first.tensors);
  EXPECT_EQ(read->nbytes, first.nbytes);
  EXPECT_EQ(read->manifest_hash, first.manifest_hash);
  EXPECT_TRUE(read->sharded);
  // Each holding rank once, with this update's seq and no region: the
  // regions stay the kept plan's (no copy of them an update).
  ASSERT_EQ(read->holders.size(), 2u);
  for (const auto& h : read->holders) {
    EXPECT_EQ(h.tensor, -1);
    EXPECT_TRUE(h.offsets.empty() && h.lengths.empty());
    EXPECT_EQ(h.seq, (h.rank == 0 ? 3u : 4u) + 10);
  }
  EXPECT_EQ(read->holders[0].rank, 0);
  EXPECT_EQ(read->holders[1].rank, 1);
  EXPECT_TRUE(read->wanters.empty());
  // Without a kept plan the reference cannot be read as a plan.
  EXPECT_FALSE(plan_from_proto(r.asReader()).ok());
  // A rank the kept plan lacks, a rank listed twice, another manifest.
  r.getHolders()[1].setRank(2);
  EXPECT_FALSE(plan_by_reference(r.asReader(), *kept).ok());
  r.getHolders()[1].setRank(0);
  EXPECT_FALSE(plan_by_reference(r.asReader(), *kept).ok());
  r.getHolders()[1].setRank(1);
  r.setManifestHash(r.getManifestHash() ^ 1);
  auto other = plan_by_reference(r.asReader(), *kept);
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("manifest hash"), std::string::npos) << other.status().message();
  // Any region of the shape moves its digest.
  UpdatePlan moved = first;
  moved.holders[0].lengths[0] = 1;
  EXPECT_NE(sharded_shape_digest(moved), digest);
}

// Sizes a peer sends are summed with overflow checks: two tensors of 2^63
// bytes each make a total of 0 in unchecked arithmetic.
TEST(PlanTest, ReceivedPlanWhoseSizesOverflowIsRefused) {
  std::vector<TensorSpec> t = {{"a", DType::kI16, {1}}, {"b", DType::kI16, {1}}};
  auto p = build_plan(3, t, opts(8192, 2048));
  ASSERT_TRUE(p.ok());
  capnp::MallocMessageBuilder b;
  plan_to_proto(*p, b.initRoot<proto::Plan>());
  auto tensors = b.getRoot<proto::Plan>().getTensors();
  // Two tensors of 2^63 bytes each (I16 of 2^62 elements): each fits, their sum does not.
  for (uint32_t i = 0; i < 2; ++i) {
    tensors[i].initShape(1).set(0, int64_t{1} << 62);
    tensors[i].setNbytes(uint64_t{1} << 63);
  }
  b.getRoot<proto::Plan>().setTotalBytes(0);
  auto bad = plan_from_proto(b.getRoot<proto::Plan>().asReader());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Code::kProtocol);
  EXPECT_NE(bad.status().message().find("overflows 64 bits at tensor 'b'"), std::string::npos)
      << bad.status().message();
}

TEST(PlanTest, ManifestHashSeesNamesShapesDtypes) {
  std::vector<TensorSpec> a = {{"w", DType::kF32, {2, 3}}};
  auto b = a;
  b[0].shape = {3, 2};
  auto c = a;
  c[0].dtype = DType::kBF16;
  auto d = a;
  d[0].name = std::string("v");  // not = "v": GCC 12 -O3 bogus -Wrestrict (GCC bug 105329)
  EXPECT_NE(manifest_hash(a), manifest_hash(b));
  EXPECT_NE(manifest_hash(a), manifest_hash(c));
  EXPECT_NE(manifest_hash(a), manifest_hash(d));
}

TEST(PlanTest, MismatchMessagesSayExpectedAndGot) {
  Mismatch m{Mismatch::Kind::kShape, "lm_head.weight", "[32000, 4096]", "[32000, 4097]"};
  EXPECT_EQ(m.to_string(), "'lm_head.weight': shape expected [32000, 4096], got [32000, 4097]");
}

// A streamed plan's buckets come from the network one by one: each is
// checked against the plan before it is received, and the end checks that
// every tensor was covered whole.
TEST(PlanTest, StreamedBucketsAreCheckedAsTheyArrive) {
  std::vector<TensorSpec> t = {{"a", DType::kF32, {100}}, {"b", DType::kU8, {5000}}};
  auto plan = build_streamed_plan(4, t, opts(4096, 1024));
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->streamed);
  EXPECT_TRUE(plan->buckets.empty());
  EXPECT_EQ(plan->bucket_bytes, 4096u);
  auto expect_refused = [&](PlanBucket b, const std::string& says) {
    UpdatePlan p = *plan;
    Status s = p.add_streamed_bucket(std::move(b));
    EXPECT_EQ(s.code(), Code::kProtocol) << s.to_string();
    EXPECT_NE(s.message().find(says), std::string::npos) << s.to_string();
    EXPECT_TRUE(p.buckets.empty());
  };
  expect_refused(PlanBucket{8192, true, {PlanPiece{1, 0, 0, 8192}}}, "exceeds the plan's bucket size 4096");
  expect_refused(PlanBucket{400, false, {PlanPiece{7, 0, 0, 400}}}, "piece names tensor #7 of 2");
  expect_refused(PlanBucket{400, false, {PlanPiece{0, 200, 0, 400}}}, "lies outside its tensor or bucket");
  expect_refused(PlanBucket{100, false, {PlanPiece{0, 0, 0, 400}}}, "lies outside its tensor or bucket");
  expect_refused(PlanBucket{400, true, {PlanPiece{0, 0, 0, 200}, PlanPiece{0, 200, 200, 200}}},
                 "direct bucket must be one whole piece");
  expect_refused(PlanBucket{0, false, {}}, "a bucket without pieces");
  // Each tensor's bytes in order, none twice, none skipped; packed pieces whole.
  expect_refused(PlanBucket{200, false, {PlanPiece{0, 0, 0, 200}}}, "packed piece of tensor 'a' carries 200 of its 400");
  expect_refused(PlanBucket{2000, true, {PlanPiece{1, 1000, 0, 2000}}}, "starts at byte 1000, expected 0");

  UpdatePlan p = *plan;
  ASSERT_TRUE(p.add_streamed_bucket(PlanBucket{4096, true, {PlanPiece{1, 0, 0, 4096}}}).ok());
  ASSERT_TRUE(p.add_streamed_bucket(PlanBucket{400, false, {PlanPiece{0, 0, 0, 400}}}).ok());
  Status twice = p.add_streamed_bucket(PlanBucket{400, false, {PlanPiece{0, 0, 0, 400}}});
  EXPECT_NE(twice.message().find("cover more than the 400 bytes of 'a'"), std::string::npos) << twice.to_string();
  Status again = p.add_streamed_bucket(PlanBucket{500, true, {PlanPiece{1, 0, 0, 500}}});  // b's first bytes again
  EXPECT_NE(again.message().find("starts at byte 0, expected 4096"), std::string::npos) << again.to_string();
  Status early = p.end_stream();
  EXPECT_EQ(early.code(), Code::kProtocol);
  EXPECT_NE(early.message().find("ended with 4096 of the 5000 bytes of 'b' sent"), std::string::npos)
      << early.to_string();
  ASSERT_TRUE(p.add_streamed_bucket(PlanBucket{904, true, {PlanPiece{1, 4096, 0, 904}}}).ok());
  EXPECT_TRUE(p.end_stream().ok());

  // On the wire: a streamed plan lists no buckets and bounds their size.
  capnp::MallocMessageBuilder m;
  auto w = m.initRoot<proto::Plan>();
  plan_to_proto(*plan, w);
  auto back = plan_from_proto(w.asReader());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_TRUE(back->streamed);
  EXPECT_EQ(back->bucket_bytes, 4096u);
  w.setBucketBytes(kMaxStreamedBucketBytes + 1);
  EXPECT_EQ(plan_from_proto(w.asReader()).status().code(), Code::kProtocol);
  w.setBucketBytes(4096);
  w.initBuckets(1);
  EXPECT_NE(plan_from_proto(w.asReader()).status().message().find("a streamed plan lists buckets"), std::string::npos);
}

// A packed bucket moves in place only when its tensors tile it to its end:
// one rounded up past its last piece (an empty tensor last) is staged.
TEST(PlanTest, InPlaceOnlyWhenThePiecesReachTheBucketsEnd) {
  std::vector<TensorSpec> t = {{"a", DType::kF32, {25}}, {"b", DType::kF32, {0}}};
  auto plan = build_plan(1, t, opts(1 << 20, 4096));
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->buckets.size(), 1u);
  alignas(256) uint8_t arena[512];
  auto buffer = [&](uint32_t i) -> void* { return i == 0 ? arena : arena + 100; };
  ASSERT_EQ(plan->buckets[0].bytes, 256u) << "the empty tensor is placed at the next 256-byte boundary";
  EXPECT_EQ(plan->in_place_base(0, buffer), nullptr) << "256 bytes would land on a's 100";
  std::vector<TensorSpec> one = {{"a", DType::kF32, {25}}};
  auto single = build_plan(1, one, opts(1 << 20, 4096));
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(single->buckets[0].bytes, 100u);
  EXPECT_EQ(single->in_place_base(0, buffer), arena);
}

// Chunks of a large tensor are whole 256-byte blocks whatever bucket_size
// says, and a bucket's delta unit divides every piece of it.
TEST(PlanTest, ChunksAreWholeBlocksAndUnitsDivideEveryPiece) {
  std::vector<TensorSpec> t = {{"w", DType::kF32, {3000}}, {"h", DType::kBF16, {7}}, {"s", DType::kF32, {3}}};
  auto plan = build_plan(1, t, opts(4097, 1024));
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->buckets.size(), 4u);  // 12000 bytes in 4096-byte chunks, then h and s packed
  EXPECT_EQ(plan->buckets[0].bytes, 4096u);
  EXPECT_EQ(plan->bucket_unit(0), 4u);
  EXPECT_EQ(plan->bucket_unit(3), 2u);
  auto streamed = build_streamed_plan(1, t, opts(4097, 1024));
  ASSERT_TRUE(streamed.ok());
  EXPECT_EQ(streamed->bucket_bytes % kPackAlignment, 0u);
  UpdatePlan p = *streamed;
  ASSERT_TRUE(p.add_streamed_bucket(PlanBucket{14, false, {PlanPiece{2, 0, 2, 12}}}).ok());
  EXPECT_EQ(p.bucket_unit(0), 2u) << "an F32 piece at an odd offset is compared in smaller units";
}

}  // namespace
}  // namespace paramcast
