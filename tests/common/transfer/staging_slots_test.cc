// The one staged-slot rule (common/transfer/staging_slots.h): buckets that
// need a slot take them in turn, whatever their index or kind, and each
// waits for the slot's previous user.
#include "common/transfer/staging_slots.h"

#include <gtest/gtest.h>

#include <random>

namespace paramcast::transfer {
namespace {

TEST(StagingSlotsTest, TurnsFollowTheBucketsThatNeedASlotNotTheirIndex) {
  StagingSlots s;
  EXPECT_EQ(s.next_slot(), 0u);
  EXPECT_FALSE(s.blocker());
  EXPECT_EQ(s.take(0), 0u);  // an encoded bucket 0
  // bucket 1 unchanged, bucket 2 direct: no slot
  EXPECT_EQ(s.next_slot(), 1u);
  EXPECT_FALSE(s.blocker());
  EXPECT_EQ(s.take(3), 1u);  // a dense staged bucket 3: the other slot, though 3 % 2 == 1 == 0 + 1 by chance
  EXPECT_EQ(s.blocker(), 0u);
  EXPECT_EQ(s.take(4), 0u);  // bucket 4 (4 % 2 == 0) takes slot 0 after bucket 0 finished
  EXPECT_EQ(s.blocker(), 3u);
  EXPECT_EQ(s.take(6), 1u);  // bucket 6 (6 % 2 == 0) takes slot 1: the one bucket 3 used
  s.reset();
  EXPECT_EQ(s.next_slot(), 0u);
  EXPECT_FALSE(s.blocker());
}

// Any sequence of buckets, some needing a slot: no two buckets that may be in
// flight together (a bucket is in flight from its take until the take that
// names it as blocker) ever share a slot.
TEST(StagingSlotsTest, NoTwoBucketsInFlightShareASlot) {
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    StagingSlots s;
    std::vector<size_t> slot_of;       // per taken bucket, in order
    std::vector<size_t> finished_upto;  // buckets known finished before each take
    size_t finished = 0;                // buckets [0, finished) of the taken ones are finished
    std::vector<size_t> taken;
    for (size_t k = 0; k < 64; ++k) {
      if (rng() % 3 == 0) continue;  // needs no slot
      if (auto b = s.blocker()) {
        // The caller finishes the blocker (and everything before it) first.
        while (finished < taken.size() && taken[finished] <= *b) ++finished;
      }
      const size_t slot = s.take(k);
      // Every taken bucket not finished yet uses the other slot.
      for (size_t i = finished; i < taken.size(); ++i) EXPECT_NE(slot_of[i], slot) << "bucket " << k;
      taken.push_back(k);
      slot_of.push_back(slot);
    }
  }
}

}  // namespace
}  // namespace paramcast::transfer
