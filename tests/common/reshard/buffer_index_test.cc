// How a rank finds its buffers for a sharded update's transfers
// (common/reshard/executor.h): by the update plan's tensor index, which is
// also the index every transfer of sharded_moves() names; and how a region
// is copied between two buffers (copy_region, contiguous_at), against an
// element-by-element copy. Pure: no process, no socket.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <set>

#include "common/reshard/executor.h"
#include "common/reshard/sharded_update.h"

namespace paramcast::reshard {
namespace {

TEST(BufferIndexTest, FindsTheBoxOfThatTensorWhichContainsTheRegion) {
  uint8_t top[8], bottom[8], other[8];
  BufferIndex index(3);
  index.add(1, top, Region{{0, 0}, {2, 4}});
  index.add(1, bottom, Region{{2, 0}, {2, 4}});
  index.add(2, other, Region{{0, 0}, {4, 4}});
  index.add(7, other, Region{{0, 0}, {4, 4}});  // not the plan's: ignored
  EXPECT_EQ(index.find(1, Region{{0, 1}, {1, 2}}).data, top);
  EXPECT_EQ(index.find(1, Region{{3, 0}, {1, 4}}).data, bottom);
  EXPECT_EQ(index.find(1, Region{{3, 0}, {1, 4}}).box, (Region{{2, 0}, {2, 4}}));
  EXPECT_EQ(index.find(1, Region{{1, 0}, {2, 4}}).data, nullptr) << "straddles both boxes: in neither";
  EXPECT_EQ(index.find(0, Region{{0, 0}, {1, 1}}).data, nullptr) << "a tensor with no buffer";
  EXPECT_EQ(index.find(2, Region{{0, 0}, {4, 4}}).data, other);
  EXPECT_EQ(index.find(7, Region{{0, 0}, {1, 1}}).data, nullptr);
}

TEST(BufferIndexTest, HeldBuffersFindEachShardByItsTensorsIndexInThePlan) {
  UpdatePlan plan;
  plan.sharded = true;
  plan.tensors = {{"b", DType::kF32, {4}}, {"a", DType::kF32, {4}}};
  plan.holders = {{0, 0, {0}, {2}, 0, std::nullopt},
                  {0, 1, {2}, {2}, 0, std::nullopt},
                  {1, 0, {2}, {2}, 1, std::nullopt},
                  {1, 1, {0}, {2}, 1, std::nullopt}};
  auto moves = sharded_moves(plan, 3, {"publisher", "trainer-1", "worker-1"});
  ASSERT_TRUE(moves.ok()) << moves.status().to_string();
  EXPECT_EQ(moves->by_name.at("a"), 1u);
  EXPECT_EQ(moves->by_name.at("b"), 0u);
  std::vector<ShardView> shards(3);
  float a[2], b[2], c[2];
  shards[0].local = {{"a", DType::kF32, {2}}, a, Device{}};
  shards[1].local = {{"b", DType::kF32, {2}}, b, Device{}};
  shards[2].local = {{"c", DType::kF32, {2}}, c, Device{}};  // not in the plan
  const auto index = held_buffers(*moves, shards, {{0, Region{{2}, {2}}}, {1, Region{{0}, {2}}}, {2, Region{{0}, {2}}}});
  ASSERT_NE(index->locate(1, Region{{2}, {2}}), nullptr);
  EXPECT_EQ(index->locate(1, Region{{2}, {2}})->data, reinterpret_cast<uint8_t*>(a));
  EXPECT_EQ(index->find(0, Region{{0}, {1}}).data, reinterpret_cast<uint8_t*>(b));
  EXPECT_EQ(index->locate(0, Region{{2}, {2}}), nullptr) << "rank holds only b's first rows";
}

// Rank 1 holds "z" and rank 2 holds "y", planned in that order, while the
// plan lists them y first: every transfer names the plan's index.
TEST(BufferIndexTest, ShardedMovesNameTheUpdatePlansTensorIndices) {
  UpdatePlan plan;
  plan.sharded = true;
  plan.tensors = {{"y", DType::kF32, {4, 2}}, {"z", DType::kF32, {4, 2}}, {"x", DType::kF32, {2}}};
  plan.holders = {{0, 2, {0}, {2}, 0, std::nullopt},
                  {1, 1, {0, 0}, {4, 2}, 1, std::nullopt},
                  {2, 0, {0, 0}, {2, 2}, 1, std::nullopt},
                  {0, 0, {2, 0}, {2, 2}, 0, std::nullopt}};
  auto moves = sharded_moves(plan, 4, {"publisher", "trainer-1", "trainer-2", "worker-1"});
  ASSERT_TRUE(moves.ok()) << moves.status().to_string();
  EXPECT_EQ(moves->plan.tensors, plan.tensors);
  std::set<std::pair<int, uint32_t>> sent;
  for (const auto& x : moves->plan.transfers) {
    EXPECT_EQ(x.to, 3);
    sent.insert({x.from, x.tensor});
  }
  EXPECT_EQ(sent, (std::set<std::pair<int, uint32_t>>{{0, 0}, {0, 2}, {1, 1}, {2, 0}}));
}

// A box of `shape` at random, of at least one element per dimension, its
// first dimensions often of length 1 (a row of a row range).
Region random_box(std::mt19937& rng, const std::vector<int64_t>& shape) {
  Region r{std::vector<int64_t>(shape.size()), std::vector<int64_t>(shape.size())};
  for (size_t d = 0; d < shape.size(); ++d) {
    const bool whole = rng() % 3 == 0, one = rng() % 4 == 0;
    r.offsets[d] = whole ? 0 : static_cast<int64_t>(rng() % static_cast<uint64_t>(shape[d]));
    const int64_t room = shape[d] - r.offsets[d];
    r.lengths[d] = whole ? shape[d] : one ? 1 : 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(room));
  }
  return r;
}

// Element `at` (global indices) of a row-major buffer holding `box`, as a byte offset.
uint64_t at_of(const Region& box, const std::vector<int64_t>& at, size_t element) {
  uint64_t o = 0;
  for (size_t d = 0; d < box.rank(); ++d) o = o * static_cast<uint64_t>(box.lengths[d]) + (at[d] - box.offsets[d]);
  return o * element;
}

// copy_region (one memcpy where the region lies back to back at both ends,
// else run by run) writes exactly what an element-by-element copy writes,
// for boxes and regions of ranks 0 to 4, contiguous or not at either end.
TEST(RegionCopyTest, CopiesWhatAnElementByElementCopyCopies) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 3000; ++trial) {
    const size_t rank = trial % 5, element = 1 + trial % 3;
    std::vector<int64_t> shape(rank);
    for (auto& n : shape) n = 1 + static_cast<int64_t>(rng() % 6);
    const Region from = random_box(rng, shape), to = random_box(rng, shape);
    const auto common = intersect(from, to);
    if (!common) continue;
    const Region region = random_box(rng, common->lengths);  // inside both, shifted into place
    Region inside = region;
    for (size_t d = 0; d < rank; ++d) inside.offsets[d] += common->offsets[d];
    std::vector<uint8_t> src(from.elements() * element), got(to.elements() * element, 0xee), want = got;
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(rng());
    copy_region(src.data(), from, got.data(), to, inside, element);
    std::vector<int64_t> at = inside.offsets;  // every element of the region, by an odometer
    for (uint64_t k = 0; k < inside.elements(); ++k) {
      std::memcpy(want.data() + at_of(to, at, element), src.data() + at_of(from, at, element), element);
      for (size_t d = rank; d-- > 0;) {
        if (++at[d] < inside.offsets[d] + inside.lengths[d]) break;
        at[d] = inside.offsets[d];
      }
    }
    ASSERT_EQ(got, want) << "from " << from.to_string() << " to " << to.to_string() << ": " << inside.to_string();
    if (const auto off = contiguous_at(from, inside, element)) {  // back to back: where its first element is
      EXPECT_EQ(*off, at_of(from, inside.offsets, element)) << from.to_string() << " " << inside.to_string();
    }
  }
}

}  // namespace
}  // namespace paramcast::reshard
