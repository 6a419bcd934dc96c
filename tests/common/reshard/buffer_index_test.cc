// How a rank finds its buffers for a sharded update's transfers
// (common/reshard/executor.h): by the update plan's tensor index, which is
// also the index every transfer of sharded_moves() names. Pure: no process,
// no socket.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace paramcast::reshard
