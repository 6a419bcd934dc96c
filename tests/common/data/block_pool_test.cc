// BlockPool (the staging pool of every DeviceMemory) and AbortReaper (the
// NCCL backend's non-blocking teardown; plain C++, so it runs here).
#include "common/data/block_pool.h"

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <set>
#include <thread>

#include "common/data/device_memory.h"
#include "common/data/nccl/abort_reaper.h"

namespace paramcast {
namespace {

struct CountingAllocator {
  int allocs = 0, frees = 0;
  bool fail_next = false;
  std::set<void*> live;
  BlockPool::Alloc alloc() {
    return [this](size_t n) -> void* {
      if (fail_next) {
        fail_next = false;
        return nullptr;
      }
      ++allocs;
      void* p = std::malloc(n ? n : 1);
      live.insert(p);
      return p;
    };
  }
  BlockPool::Free free() {
    return [this](void* p) {
      ++frees;
      live.erase(p);
      std::free(p);
    };
  }
};

TEST(BlockPoolTest, ReleasedBlocksAreReusedWithoutTheAllocator) {
  CountingAllocator a;
  {
    BlockPool pool(a.alloc(), a.free(), 1 << 20);
    void* x = pool.take(1000);
    ASSERT_NE(x, nullptr);
    EXPECT_TRUE(pool.give_back(x));
    EXPECT_FALSE(pool.give_back(&a));  // not ours
    EXPECT_EQ(pool.take(900), x);      // fits, not too large: reused
    EXPECT_EQ(a.allocs, 1);
    EXPECT_EQ(pool.hits(), 1u);
    void* y = pool.take(5000);  // larger than anything cached
    EXPECT_NE(y, x);
    EXPECT_EQ(a.allocs, 2);
    pool.give_back(y);
    EXPECT_EQ(pool.cached_bytes(), 5000u);
  }
  EXPECT_EQ(a.frees, 2);  // the destructor frees cached and live blocks alike
  EXPECT_TRUE(a.live.empty());
}

TEST(BlockPoolTest, FarLargerBlocksAreNotHandedToSmallRequests) {
  CountingAllocator a;
  BlockPool pool(a.alloc(), a.free(), 64 << 20);
  void* big = pool.take(8 << 20);
  pool.give_back(big);
  void* small = pool.take(1000);  // 8 MiB > 2 * 1000 + 1 MiB: a fresh block
  EXPECT_NE(small, big);
  EXPECT_EQ(pool.take(4 << 20), big);  // 8 MiB <= 2 * 4 MiB + 1 MiB
}

TEST(BlockPoolTest, CacheIsBoundedAndFreedWhenTheAllocatorFails) {
  CountingAllocator a;
  BlockPool pool(a.alloc(), a.free(), 10000);
  void* b1 = pool.take(6000);
  void* b2 = pool.take(6000);
  pool.give_back(b1);
  pool.give_back(b2);  // 12000 > 10000: one block freed at once
  EXPECT_EQ(pool.cached_bytes(), 6000u);
  EXPECT_EQ(a.frees, 1);
  a.fail_next = true;  // the allocator fails once: the cache goes, then a retry
  void* c = pool.take(50000);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(pool.cached_bytes(), 0u);
  EXPECT_EQ(a.frees, 2);
}

TEST(BlockPoolTest, HostMemoryCountsLiveBytesAndReusesStaging) {
  auto mem = create_device_memory(Device::cpu());
  ASSERT_TRUE(mem.ok());
  auto p = (*mem)->allocate(1 << 20);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*mem)->allocated(), 1u << 20);
  (*mem)->release(*p);
  EXPECT_EQ((*mem)->allocated(), 0u);
  auto q = (*mem)->allocate(1 << 20);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(*q, *p);  // from the pool
  EXPECT_EQ((*mem)->peak(), 1u << 20);
  (*mem)->release(*q);
}

using nccl_backend::AbortReaper;

TEST(AbortReaperTest, StartReturnsAtOnceWhileTheTeardownBlocks) {
  std::atomic<bool> release{false};
  std::atomic<int> runs{0};
  AbortReaper reaper;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(reaper.start([&] {
    ++runs;
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }));
  EXPECT_FALSE(reaper.start([&] { ++runs; }));  // once only
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_TRUE(reaper.started());
  EXPECT_FALSE(reaper.wait_for(std::chrono::milliseconds(50)));
  EXPECT_FALSE(reaper.finished());
  release = true;
  EXPECT_TRUE(reaper.wait_for(std::chrono::seconds(30)));
  EXPECT_TRUE(reaper.finished());
  EXPECT_EQ(runs, 1);
}

TEST(AbortReaperTest, DestructorNeverWaitsForAHungTeardown) {
  struct Shared {
    std::atomic<bool> go{false}, done{false};
  };
  auto shared = std::make_shared<Shared>();
  {
    AbortReaper reaper;
    reaper.start([shared] {
      while (!shared->go) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      shared->done = true;
    });
  }  // returns although the teardown is still blocked: detached, not joined
  EXPECT_FALSE(shared->done);
  shared->go = true;
  for (int i = 0; i < 3000 && !shared->done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_TRUE(shared->done);  // it ran to its end on its own
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let the detached thread exit
}

// A teardown left running by a destroyed reaper still ends before the process
// does: NCCL's abort on a thread that exit() cuts short met the CUDA
// runtime's own teardown and crashed the process (seen on an H100).
TEST(AbortReaperDeathTest, ProcessExitWaitsForATeardownStillRunning) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        {
          AbortReaper reaper;
          reaper.start([] {
            std::this_thread::sleep_for(std::chrono::milliseconds(300));
            std::fprintf(stderr, "teardown finished\n");
          });
        }  // detached, still sleeping
        std::fprintf(stderr, "teardowns running at exit: %d\n", AbortReaper::running());
        std::exit(7);
      },
      ::testing::ExitedWithCode(7), "teardowns running at exit: 1\n(.|\n)*teardown finished");
}

// A child forked while a teardown runs in its parent has no such thread: its
// exit does not wait for one (it waited out the 20 s exit bound before).
TEST(AbortReaperDeathTest, ForkedChildExitsWithoutWaitingForItsParentsTeardown) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        double secs = 0;
        {
          AbortReaper reaper;
          reaper.start([] { std::this_thread::sleep_for(std::chrono::seconds(2)); });
          const auto t0 = std::chrono::steady_clock::now();
          const pid_t child = fork();
          if (child == 0) std::exit(0);
          int status = 0;
          waitpid(child, &status, 0);
          secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        }  // detached, still sleeping: this process's exit waits for it
        std::fprintf(stderr, "forked child exited in %.2f s\n", secs);
        std::exit(secs < 10 ? 7 : 8);  // 10 s: far above a loaded fork, far below the 20 s bound
      },
      ::testing::ExitedWithCode(7), "forked child exited in");
}

TEST(AbortReaperTest, NeverStartedReaperIsFinishedNowhere) {
  AbortReaper reaper;
  EXPECT_FALSE(reaper.started());
  EXPECT_FALSE(reaper.wait_for(std::chrono::milliseconds(1)));
}

}  // namespace
}  // namespace paramcast
