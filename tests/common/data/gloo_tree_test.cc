// The Gloo backend's broadcast shape (BinomialTree) and send-side
// bookkeeping (Flight), on their own.
#include <gtest/gtest.h>

#include <set>

#include "common/data/gloo/flight.h"
#include "common/data/gloo/schedule.h"
#include "common/data/gloo/shed.h"
#include "common/data/gloo/tree.h"

namespace paramcast::gloo_backend {
namespace {

int depth_of(int rank, int world, int root) {
  int d = 0;
  for (int r = rank; r != root; r = BinomialTree::of(r, world, root).parent) ++d;
  return d;
}

// Every rank but the root has exactly one parent, which lists it among its
// children; the tree is at most ceil(log2(world)) deep, for every root.
TEST(BinomialTreeTest, EveryRankReachedOnceWithinLogDepth) {
  for (int world = 1; world <= 33; ++world) {
    int log2 = 0;
    while ((1 << log2) < world) ++log2;
    for (int root = 0; root < world; ++root) {
      std::multiset<int> children;
      for (int r = 0; r < world; ++r) {
        const auto t = BinomialTree::of(r, world, root);
        EXPECT_EQ(t.parent < 0, r == root) << "world " << world << " root " << root << " rank " << r;
        for (int c : t.children) {
          children.insert(c);
          EXPECT_EQ(BinomialTree::of(c, world, root).parent, r) << "world " << world << " root " << root;
        }
        EXPECT_LE(depth_of(r, world, root), log2) << "world " << world << " root " << root << " rank " << r;
      }
      EXPECT_EQ(children.size(), static_cast<size_t>(world - 1)) << "world " << world << " root " << root;
      for (int r = 0; r < world; ++r) EXPECT_EQ(children.count(r), r == root ? 0u : 1u);
    }
  }
}

TEST(BinomialTreeTest, LargestSubtreeFirst) {
  EXPECT_EQ(BinomialTree::of(0, 8, 0).children, (std::vector<int>{4, 2, 1}));
  EXPECT_EQ(BinomialTree::of(1, 8, 0).children, (std::vector<int>{5, 3}));
  EXPECT_EQ(BinomialTree::of(5, 8, 0).parent, 1);
  EXPECT_EQ(BinomialTree::of(3, 8, 2).children, (std::vector<int>{7, 5}));  // vrank 1 of root 2
  EXPECT_TRUE(BinomialTree::of(7, 8, 0).children.empty());
}

using Clock = Flight::Clock;

TEST(FlightTest, WindowHoldsBackAtTheSlowestChild) {
  const auto t0 = Clock::now();
  Flight f({4, 2}, t0);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(f.posted(100, t0), 2u);
  EXPECT_TRUE(f.window_open(400));
  f.posted(100, t0);
  EXPECT_FALSE(f.window_open(400));
  EXPECT_EQ(f.pending(), 8u);
  EXPECT_EQ(f.taken(4, t0).bytes, 100u);  // one child alone does not open it
  EXPECT_FALSE(f.window_open(400));
  EXPECT_EQ(f.min_taken_bytes(), 0u);
  f.taken(2, t0);
  EXPECT_TRUE(f.window_open(400));
  EXPECT_EQ(f.min_taken_bytes(), 100u);
  EXPECT_EQ(f.taken(9, t0).bytes, 0u);  // not a child
}

// The window counts bytes: many small chunks fit where one large one does.
TEST(FlightTest, WindowCountsBytesNotChunks) {
  const auto t0 = Clock::now();
  Flight f({1}, t0);
  for (int i = 0; i < 15; ++i) f.posted(1, t0);
  EXPECT_TRUE(f.window_open(16));
  f.posted(1, t0);
  EXPECT_FALSE(f.window_open(16));
  Flight g({1}, t0);
  g.posted(16, t0);
  EXPECT_FALSE(g.window_open(16));
}

// Chunks are tagged with their broadcast: the oldest pending chunk of a
// child names the broadcast whose send buffer its next completion is on.
TEST(FlightTest, OldestPendingChunkNamesItsBroadcast) {
  const auto t0 = Clock::now();
  Flight f({3, 5}, t0);
  uint32_t op = 99;
  EXPECT_FALSE(f.oldest(3, &op));
  f.posted(10, t0, 7);
  f.posted(10, t0, 8);
  ASSERT_TRUE(f.oldest(3, &op));
  EXPECT_EQ(op, 7u);
  EXPECT_EQ(f.taken(3, t0).op, 7u);
  ASSERT_TRUE(f.oldest(3, &op));
  EXPECT_EQ(op, 8u);
  ASSERT_TRUE(f.oldest(5, &op));  // the other child is still behind
  EXPECT_EQ(op, 7u);
  EXPECT_FALSE(f.oldest(4, &op));  // not a child
}

// Behind a link of kKeptLinkRate, the receive window drains within half the
// stall window; never below a chunk (no progress) nor above the send window.
TEST(ScheduleTest, ReceiveWindowFollowsTheStallWindow) {
  using std::chrono::milliseconds;
  EXPECT_EQ(receive_window_bytes(milliseconds(0)), kMaxChunkBytes);
  EXPECT_EQ(receive_window_bytes(milliseconds(3000)), kMaxChunkBytes);
  EXPECT_EQ(receive_window_bytes(milliseconds(6000)), 6 * kKeptLinkRate / 2);
  EXPECT_EQ(receive_window_bytes(milliseconds(30000)), kWindowBytes);
  for (int s = 1; s <= 60; ++s) {
    const uint64_t w = receive_window_bytes(milliseconds(s * 1000));
    if (w > kMaxChunkBytes) {
      EXPECT_LE(w / kKeptLinkRate, static_cast<uint64_t>(s) / 2) << s;
    }
  }
}

// The largest chunk: 4 MiB, less where a 2 MiB/s link would not move one
// in half the stall window or a link at the shed floor four per window.
TEST(ScheduleTest, LargestChunkFollowsTheStallWindowAndTheShedFloor) {
  using std::chrono::milliseconds;
  EXPECT_EQ(max_chunk_bytes(milliseconds(30000), 0, milliseconds(5000)), kMaxChunkBytes);
  EXPECT_EQ(max_chunk_bytes(milliseconds(3000), 0, milliseconds(5000)), size_t(3) << 20);
  EXPECT_EQ(max_chunk_bytes(milliseconds(100), 0, milliseconds(5000)), kMinChunkBytes);
  // Shed at 8 MiB/s over 2 s: four chunks of 4 MiB; at 1 MiB/s over 2 s: 512 KiB.
  EXPECT_EQ(max_chunk_bytes(milliseconds(30000), 8 << 20, milliseconds(2000)), kMaxChunkBytes);
  EXPECT_EQ(max_chunk_bytes(milliseconds(30000), 1 << 20, milliseconds(2000)), size_t(512) << 10);
  for (int ms : {1, 999, 2500, 7000, 60000}) {
    const size_t c = max_chunk_bytes(milliseconds(ms), 12345, milliseconds(ms));
    EXPECT_EQ(c % 4096, 0u) << ms;
    EXPECT_GE(c, kMinChunkBytes) << ms;
    EXPECT_LE(c, kMaxChunkBytes) << ms;
  }
  EXPECT_EQ(chunk_bytes_for(size_t(5) << 20, size_t(1) << 20), size_t(1) << 20);
  EXPECT_EQ(chunk_count(size_t(5) << 20, chunk_bytes_for(size_t(5) << 20, size_t(1) << 20)), 5u);
}

TEST(ScheduleTest, ChunksAreTheWholeBroadcastUpToTheMaximumThenEvenPieces) {
  EXPECT_EQ(chunk_bytes_for(1), 1u);
  EXPECT_EQ(chunk_bytes_for(4097), 4097u);
  EXPECT_EQ(chunk_bytes_for(kMaxChunkBytes), kMaxChunkBytes);
  // Just above the maximum: two even chunks, not a full one and a sliver.
  const size_t over = kMaxChunkBytes + 1;
  const size_t c = chunk_bytes_for(over);
  EXPECT_EQ(chunk_count(over, c), 2u);
  EXPECT_LT(over - c, c);
  EXPECT_GT(over - c, c / 2);
  EXPECT_EQ(c % 4096, 0u);
  for (size_t bytes : {size_t(3) << 20, size_t(256) << 20, (size_t(256) << 20) + 12345, size_t(1) << 30}) {
    const size_t chunk = chunk_bytes_for(bytes);
    EXPECT_LE(chunk, kMaxChunkBytes) << bytes;
    EXPECT_EQ(chunk_count(bytes, chunk), (bytes + kMaxChunkBytes - 1) / kMaxChunkBytes) << bytes;
  }
}

TEST(FlightTest, SlowestIsTheChildLongestWithoutProgressAndBusyTimeIsPerLink) {
  const auto t0 = Clock::now();
  using std::chrono::seconds;
  Flight f({1, 2}, t0);
  EXPECT_EQ(f.slowest(), nullptr);  // nothing pending: nobody is stalled
  f.posted(10, t0 + seconds(5));    // the links' clocks start with their work
  f.posted(10, t0 + seconds(6));
  auto t = f.taken(1, t0 + seconds(7));
  EXPECT_EQ(t.busy, seconds(2));
  t = f.taken(1, t0 + seconds(8));
  EXPECT_EQ(t.busy, seconds(1));
  ASSERT_NE(f.slowest(), nullptr);
  EXPECT_EQ(f.slowest()->rank, 2);
  EXPECT_EQ(f.slowest()->last_progress, t0 + seconds(5));
  f.taken(2, t0 + seconds(9));
  f.taken(2, t0 + seconds(9));
  EXPECT_EQ(f.slowest(), nullptr);
  EXPECT_EQ(f.child(2)->taken_bytes, 20u);
  f.posted(10, t0 + seconds(20));  // an idle link's clock restarts with new work
  EXPECT_EQ(f.slowest()->last_progress, t0 + seconds(20));
}

// A shed child gets no more chunks and no longer holds the window or the
// receives ahead; what it was owed still counts until taken.
TEST(FlightTest, AShedChildDrainsWhatItWasOwedAndHoldsNothingBack) {
  const auto t0 = Clock::now();
  Flight f({4, 2}, t0);
  for (int i = 0; i < 4; ++i) f.posted(100, t0);
  EXPECT_FALSE(f.window_open(400));
  for (int i = 0; i < 4; ++i) f.taken(2, t0);  // 2 is fast, 4 took nothing
  EXPECT_FALSE(f.window_open(400));
  EXPECT_EQ(f.min_taken_bytes(), 0u);
  f.mark_shed(4);
  EXPECT_TRUE(f.is_shed(4));
  EXPECT_TRUE(f.any_active());
  EXPECT_TRUE(f.window_open(400));
  EXPECT_EQ(f.min_taken_bytes(), 400u);  // only 2 counts now
  EXPECT_EQ(f.pending(), 4u);           // 4's owed chunks still drain
  f.posted(100, t0);                    // to 2 only
  EXPECT_EQ(f.child(4)->pending.size(), 4u);
  EXPECT_EQ(f.pending(), 5u);
  EXPECT_EQ(f.slowest()->rank, 4);  // and the stall check still sees it
  for (int i = 0; i < 4; ++i) f.taken(4, t0);
  f.taken(2, t0);
  EXPECT_EQ(f.pending(), 0u);
  f.mark_shed(2);
  EXPECT_FALSE(f.any_active());
}

// A shed child whose connection ended gives up what it was owed, tagged
// with the broadcasts whose completion no longer waits for it.
TEST(FlightTest, DroppingAShedChildReturnsWhatItWasOwed) {
  const auto t0 = Clock::now();
  Flight f({4, 2}, t0);
  f.posted(100, t0, 1);
  f.posted(50, t0, 2);
  f.taken(2, t0);
  f.mark_shed(4);
  const auto dropped = f.drop(4);
  ASSERT_EQ(dropped.size(), 2u);
  EXPECT_EQ(dropped[0].op, 1u);
  EXPECT_EQ(dropped[1].op, 2u);
  EXPECT_EQ(f.pending(), 1u);  // 2's second chunk
  EXPECT_EQ(f.child(4)->pending_bytes, 0u);
  EXPECT_TRUE(f.drop(4).empty());
  EXPECT_TRUE(f.drop(9).empty());
}

TEST(ShedWatchTest, ShedsOnlyBelowTheFloorOverAWholeWindowOfBusyTime) {
  using std::chrono::seconds;
  ShedWatch off(4, 0, seconds(2));
  EXPECT_FALSE(off.enabled());
  EXPECT_FALSE(off.observe(1, 1, seconds(100)).shed);

  ShedWatch w(4, 8 << 20, seconds(2));  // 8 MiB/s over 2 s
  EXPECT_FALSE(w.observe(1, 1 << 20, seconds(1)).shed);  // not a whole window yet
  auto v = w.observe(1, 32 << 20, seconds(2));           // 32 MiB in 2 s: fast
  EXPECT_FALSE(v.shed);
  EXPECT_NEAR(v.rate, 16.0 * (1 << 20), 1.0);
  v = w.observe(1, (32 << 20) + (4 << 20), seconds(4));  // 4 MiB in the next 2 s: 2 MiB/s
  EXPECT_TRUE(v.shed);
  EXPECT_NEAR(v.rate, 2.0 * (1 << 20), 1.0);
  EXPECT_TRUE(w.shed(1));
  EXPECT_FALSE(w.shed(2));
  EXPECT_FALSE(w.observe(1, 0, seconds(100)).shed);  // once is enough
}

}  // namespace
}  // namespace paramcast::gloo_backend
