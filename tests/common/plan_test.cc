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

}  // namespace
}  // namespace paramcast
