// Reaper: a communicator's last owner never waits for its teardown. The
// communicators here are real Gloo groups of one rank wrapped so that their
// teardown takes as long as a test needs (a stuck backend's would).
#include "common/data/reaper.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "common/data/file_store.h"
#include "tests/support/process.h"

namespace paramcast {
namespace {

using Ms = std::chrono::milliseconds;

struct Teardown {
  std::atomic<bool> done{false};
  std::atomic<bool> on_caller{false};
};

// A real communicator whose destructor first waits `delay`.
class SlowTeardown : public Communicator {
 public:
  SlowTeardown(std::unique_ptr<Communicator> inner, Ms delay, std::shared_ptr<Teardown> t, std::thread::id caller)
      : inner_(std::move(inner)), delay_(delay), t_(std::move(t)), caller_(caller) {}
  ~SlowTeardown() override {
    std::this_thread::sleep_for(delay_);
    t_->on_caller = std::this_thread::get_id() == caller_;
    inner_.reset();
    t_->done = true;
  }
  std::shared_ptr<Work> broadcast(void* data, size_t bytes, int root) override {
    return inner_->broadcast(data, bytes, root);
  }
  void abort(const std::string& reason) override { inner_->abort(reason); }
  Status async_error() override { return inner_->async_error(); }
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  Device device() const override { return inner_->device(); }

 private:
  std::unique_ptr<Communicator> inner_;
  Ms delay_;
  std::shared_ptr<Teardown> t_;
  std::thread::id caller_;
};

class ReaperTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::make_temp_dir("paramcast-reaper"); }
  void TearDown() override { test::remove_tree(dir_); }

  std::unique_ptr<Communicator> slow(Ms delay, std::shared_ptr<Teardown> t) {
    GroupOptions g;
    g.epoch = ++epoch_;
    g.bootstrap = "reaper-test/" + std::to_string(epoch_);
    g.device = Device::cpu();
    g.init_timeout = Ms(10000);
    FileStore store(dir_);
    auto c = create_communicator(g, store);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    return std::make_unique<SlowTeardown>(std::move(c.value()), delay, std::move(t), std::this_thread::get_id());
  }

  static bool eventually(const std::atomic<bool>& flag, Ms timeout) {
    const auto deadline = Clock::now() + timeout;
    while (!flag && Clock::now() < deadline) std::this_thread::sleep_for(Ms(5));
    return flag;
  }

  std::string dir_;
  uint64_t epoch_ = 0;
};

TEST_F(ReaperTest, LastOwnerReturnsAtOnceAndTeardownRunsOnTheReaperThread) {
  Reaper reaper;
  auto t = std::make_shared<Teardown>();
  std::shared_ptr<Communicator> comm = reaper.adopt(slow(Ms(800), t));
  std::vector<uint8_t> bytes(64, 7);
  EXPECT_TRUE(comm->broadcast(bytes.data(), bytes.size(), 0)->wait(Clock::now() + Ms(5000)).ok());
  auto copy = comm;  // a second owner (the update in flight) changes nothing
  comm.reset();
  const auto t0 = Clock::now();
  copy.reset();  // the last owner
  EXPECT_LT(Clock::now() - t0, Ms(200));
  EXPECT_EQ(reaper.pending(), 1u);
  // A new group forms while the old one is still being torn down.
  auto t2 = std::make_shared<Teardown>();
  auto next = reaper.adopt(slow(Ms(0), t2));
  EXPECT_TRUE(next->broadcast(bytes.data(), bytes.size(), 0)->wait(Clock::now() + Ms(5000)).ok());
  EXPECT_FALSE(t->done);
  ASSERT_TRUE(eventually(t->done, Ms(5000)));
  EXPECT_FALSE(t->on_caller);
}

TEST_F(ReaperTest, DestroyedReaperWaitsAtMostItsDrainTime) {
  auto t = std::make_shared<Teardown>();
  const auto t0 = Clock::now();
  {
    Reaper reaper(Ms(200));
    reaper.adopt(slow(Ms(3000), t)).reset();
  }
  EXPECT_LT(Clock::now() - t0, Ms(1500));
  EXPECT_FALSE(t->done);
  EXPECT_TRUE(eventually(t->done, Ms(6000)));  // finished on the thread left behind
}

TEST_F(ReaperTest, OwnerOutlivingItsReaperStillNeverWaits) {
  auto t = std::make_shared<Teardown>();
  std::shared_ptr<Communicator> comm;
  {
    Reaper reaper;
    comm = reaper.adopt(slow(Ms(800), t));
  }
  const auto t0 = Clock::now();
  comm.reset();
  EXPECT_LT(Clock::now() - t0, Ms(200));
  EXPECT_TRUE(eventually(t->done, Ms(5000)));
  EXPECT_FALSE(t->on_caller);
}

}  // namespace
}  // namespace paramcast
