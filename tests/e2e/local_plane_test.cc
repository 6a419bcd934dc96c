// The shm data plane with real processes: a trainer and seven workers on
// this host share the publisher's memory (data_plane.backend: shm). Every
// worker verifies every byte; a killed reader is named within
// heartbeat_timeout + 2 s and the publisher is not blocked by it; a reader
// that stops taking bytes while its control thread heartbeats is named by
// the stall timeout; a killed publisher leaves its readers dirty, not hung;
// and nothing is left in /dev/shm (the segment is a memfd).
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>
#include <set>

#include "tests/support/deployments.h"
#include "tests/support/netns.h"
#include "tests/support/worker_cluster.h"

namespace paramcast {
namespace {

using Ms = std::chrono::milliseconds;
using test::Process;
using test::WorkerClusterTest;

std::set<std::string> dev_shm() {
  std::set<std::string> names;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) names.insert(e->d_name);
    closedir(d);
  }
  return names;
}

std::string shm_yaml(int subscribers, const std::string& extra_publisher = "", const std::string& stall = "20s") {
  std::string y = test::test_config_yaml(subscribers, extra_publisher);
  auto replace = [&](const std::string& from, const std::string& to) {
    const auto at = y.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) y.replace(at, from.size(), to);
  };
  replace("backend: gloo", "backend: shm");
  replace("stall_timeout: 20s", "stall_timeout: " + stall);
  return y;
}

TEST(LocalPlaneTest, LocalShmDeploymentSucceedsAndEveryWorkerVerifies) {
  const auto before = dev_shm();
  const std::string out = test::launch_and_expect_every_worker_verified("deploy/local-shm.yaml");
  EXPECT_NE(out.find("(shm"), std::string::npos) << "the group formed over shm:\n" << out;
  EXPECT_EQ(dev_shm(), before) << "nothing is left in /dev/shm";
}

class LocalPlaneClusterTest : public WorkerClusterTest {};

TEST_F(LocalPlaneClusterTest, KilledReaderIsNamedAndTheNextUpdateReachesTheOthers) {
  make_publisher(shm_yaml(3, "  on_member_loss: continue\n"));
  spawn_worker("worker-1", {"PARAMCAST_FAULT_STALL_AFTER_BUCKET=1"});
  spawn_worker("worker-2");
  spawn_worker("worker-3");
  ASSERT_TRUE(pub_->start().ok());
  model_ = test::make_tensors(synthetic_llm_layout(config_.trainer.model_bytes, config_.trainer.layers,
                                                   config_.trainer.dtype));
  model_.fill(1, config_.trainer.seed);
  auto fut = pub_->weight_update_async(model_.views(), 1);
  ASSERT_TRUE(workers_["worker-1"]->wait_for_output("stalling after bucket 1", std::chrono::seconds(20)))
      << workers_["worker-1"]->output();
  workers_["worker-1"]->kill(SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  const auto bound = config_.control.heartbeat_timeout + std::chrono::seconds(2);
  ASSERT_EQ(fut.wait_for(bound + std::chrono::seconds(5)), std::future_status::ready) << "weight_update hung";
  UpdateResult r = fut.get();
  EXPECT_LE(std::chrono::steady_clock::now() - killed, bound);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status.message().find("worker-1"), std::string::npos) << r.status.to_string();
  // The group re-forms without it; the others get the next version.
  UpdateResult r2 = publish(2);
  ASSERT_TRUE(r2.ok()) << r2.status.to_string();
  for (const char* id : {"worker-2", "worker-3"})
    EXPECT_TRUE(workers_[id]->wait_for_output("v2 verified", std::chrono::seconds(10))) << workers_[id]->output();
}

// A member that says GroupReady without ever taking the publisher's shared
// memory (a liar with a valid identity): the root names it ("did not
// attach"), it is quarantined at once on that evidence, and the group forms
// again without it in the same call: the first update already reaches the
// others. (Before, every formation failed at init_timeout, the publisher
// blaming itself, and nobody was struck.)
TEST_F(LocalPlaneClusterTest, AMemberThatSaysReadyWithoutAttachingIsNamedStruckAndTheOthersGetTheUpdate) {
  std::string yaml = shm_yaml(3, "  on_member_loss: continue\n");
  yaml.replace(yaml.find("init_timeout: 30s"), 17, "init_timeout: 3s");
  make_publisher(yaml);
  spawn_worker("worker-1");
  spawn_worker("worker-2", {"PARAMCAST_FAULT_FALSE_READY=1"});
  spawn_worker("worker-3");
  ASSERT_TRUE(pub_->start().ok()) << outputs();
  UpdateResult r = publish(1);
  ASSERT_TRUE(r.ok()) << r.status.to_string() << outputs();
  EXPECT_EQ(r.missing, std::vector<std::string>{"worker-2"});
  EXPECT_EQ(r.subscribers.size(), 2u);
  for (const char* id : {"worker-1", "worker-3"})
    EXPECT_TRUE(workers_[id]->wait_for_output("v1 verified", std::chrono::seconds(10))) << workers_[id]->output();
}

// worker-2's data thread wedges after bucket 1 while its control thread
// keeps heartbeating: the root sees it take nothing and names it.
TEST_F(LocalPlaneClusterTest, ReaderThatStopsTakingBytesIsNamedByTheStallTimeout) {
  make_publisher(shm_yaml(3, "", "2s"));
  spawn_worker("worker-1");
  spawn_worker("worker-2", {"PARAMCAST_FAULT_STALL_AFTER_BUCKET=1"});
  spawn_worker("worker-3");
  ASSERT_TRUE(pub_->start().ok());
  const auto t0 = std::chrono::steady_clock::now();
  UpdateResult r = publish(1);
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status.code(), Code::kTimeout) << r.status.to_string();
  EXPECT_NE(r.status.message().find("rank 2 (worker-2)"), std::string::npos) << r.status.to_string();
  EXPECT_NE(r.status.message().find("stall_timeout 2.000 s"), std::string::npos) << r.status.to_string();
  EXPECT_LE(took, std::chrono::seconds(2 + 8)) << "the stall window, and slack for a loaded machine";
}

// The same stalled reader costs one update, not every one: the root saw it
// alone take nothing (the others took what it could give them), so it is
// quarantined at once and the next update forms without it. Before, the next
// formation waited init_timeout (30 s here) for its wedged data thread.
TEST_F(LocalPlaneClusterTest, AReaderThatStallsIsStruckAndTheNextUpdateFormsWithoutIt) {
  make_publisher(shm_yaml(3, "  on_member_loss: continue\n", "2s"));
  spawn_worker("worker-1");
  spawn_worker("worker-2", {"PARAMCAST_FAULT_STALL_AFTER_BUCKET=1"});
  spawn_worker("worker-3");
  ASSERT_TRUE(pub_->start().ok());
  ::testing::internal::CaptureStderr();
  UpdateResult r = publish(1);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status.message().find("rank 2 (worker-2)"), std::string::npos) << r.status.to_string();
  const auto t0 = std::chrono::steady_clock::now();
  UpdateResult r2 = publish(2);
  const auto took = std::chrono::steady_clock::now() - t0;
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(r2.ok()) << r2.status.to_string() << "\n" << log << outputs();
  EXPECT_EQ(r2.missing, std::vector<std::string>{"worker-2"});
  EXPECT_LE(took, std::chrono::seconds(8)) << "no formation waited for the stalled reader:\n" << log;
  EXPECT_NE(log.find("subscriber 'worker-2' quarantined for 30.000 s at once (took no bytes from the publisher's "
                     "shared memory for stall_timeout"),
            std::string::npos)
      << log;
  for (const char* id : {"worker-1", "worker-3"}) {
    EXPECT_TRUE(workers_[id]->wait_for_output("v2 verified", std::chrono::seconds(10))) << workers_[id]->output();
    EXPECT_EQ(log.find("subscriber '" + std::string(id) + "' quarantined"), std::string::npos) << log;
  }
}

TEST_F(LocalPlaneClusterTest, KilledPublisherLeavesReadersDirtyNotHungAndNothingInDevShm) {
  const auto before = dev_shm();
  const std::string yaml_path = test::write_file(dir_, "deploy.yaml", shm_yaml(3));
  config_ = load_config_file(yaml_path).value();
  auto killed = test::kill_publisher_mid_update(dir_, yaml_path, config_);
  ASSERT_FALSE(HasFailure());
  for (auto& w : killed.workers) w->kill(SIGKILL);
  for (auto& w : killed.workers) w->wait_for(std::chrono::seconds(10));
  EXPECT_EQ(dev_shm(), before) << "nothing is left in /dev/shm after a SIGKILLed publisher";
}

// A mixed group: the trainer and two workers share a network namespace (one
// host, as their Hellos say), two more workers run in namespaces of their
// own behind veths. With data_plane.local: auto the two beside the trainer
// read its shared memory and the other two get the same buckets over Gloo,
// in the same updates; every worker verifies every byte.
// `forger`: a member that reports in every Applied that it shed the
// others (PARAMCAST_FAULT_CLAIM_SHED), with publisher.on_slow_member: shed.
void run_mixed_group(const std::string& forger) {
  std::string why;
  auto lab = test::NetworkLab::create(3, &why);
  if (!lab) GTEST_SKIP() << "cannot build network namespaces here: " << why;
  const std::string dir = test::make_temp_dir("paramcast-mixed");
  const std::string endpoint = "tcp://" + lab->address(0) + ":29501";
  const std::string yaml = test::write_file(
      dir, "deploy.yaml",
      "control:\n  endpoint: " + endpoint +
          "\n  heartbeat_interval: 100ms\n  heartbeat_timeout: 1500ms\n  join_timeout: 30s\n"
          "data_plane:\n  backend: gloo\n  local: auto\n  gloo_interface: " + test::NetworkLab::kInterface +
          "\n  bucket_size: 1MiB\n  checksum: xxh64\n  init_timeout: 20s\n"
          "publisher:\n  subscribers: [local-1, local-2, remote-1, remote-2]\n" +
          (forger.empty() ? "" : "  on_slow_member: shed\n  slow_member_floor: 1KiB\n") +
          "trainer:\n  model_size: 16MiB\n  layers: 8\n  updates: 4\n"
          "logging:\n  level: info\n"
          "auth:\n  mode: plain\n");  // the lab's private network
  auto trainer = Process::start(lab->exec_path(), lab->exec_args(0, test::binary("paramcast-trainer"), {"--config", yaml}));
  ASSERT_TRUE(trainer->wait_for_output("control endpoint", Ms(10000))) << trainer->output();
  std::vector<std::pair<std::string, std::unique_ptr<Process>>> workers;
  const std::pair<const char*, int> where[] = {{"local-1", 0}, {"local-2", 0}, {"remote-1", 1}, {"remote-2", 2}};
  for (const auto& [id, node] : where) {
    std::vector<std::string> env;
    if (id == forger) env.push_back("PARAMCAST_FAULT_CLAIM_SHED=local-1,local-2,remote-1,remote-2");
    workers.emplace_back(id, Process::start(lab->exec_path(),
                                            lab->exec_args(node, test::binary("paramcast-worker"),
                                                           {"--config", yaml, "--id", id, "--endpoint", endpoint,
                                                            "--updates", "4"}),
                                            env));
  }
  auto code = trainer->wait_for(std::chrono::seconds(120));
  ASSERT_TRUE(code.has_value()) << trainer->output();
  EXPECT_EQ(*code, 0) << trainer->output();
  EXPECT_NE(trainer->output().find("4 updates, 0 failed"), std::string::npos) << trainer->output();
  for (auto& [id, w] : workers) {
    auto wc = w->wait_for(std::chrono::seconds(30));
    ASSERT_TRUE(wc.has_value()) << id << ":\n" << w->output();
    EXPECT_EQ(*wc, 0) << id << ":\n" << w->output();
    EXPECT_NE(w->output().find(id + ": 4 updates verified, 0 failed"), std::string::npos) << id << ":\n"
                                                                                          << w->output();
  }
  // Who went where: the trainer's formation line says so.
  EXPECT_NE(trainer->output().find("shm: local-1, local-2"), std::string::npos) << trainer->output();
  if (!forger.empty()) {
    // Nobody was reported shed: the forger is no member's parent on the Gloo
    // plane (the publisher is both remote members'), and the claims are named.
    EXPECT_EQ(trainer->output().find("shed:"), std::string::npos) << trainer->output();
    EXPECT_EQ(trainer->output().find("(shed)"), std::string::npos) << trainer->output();
    EXPECT_NE(trainer->output().find("'" + forger + "' reported on the link to"), std::string::npos) << trainer->output();
  }
  test::remove_tree(dir);
}

TEST(LocalPlaneTest, MixedGroupLocalMembersOverShmRemoteOverGlooBitExact) { run_mixed_group(""); }

// A member on the shm plane that claims, in every Applied, to have shed the
// three others (members with valid identities can say anything): every
// update still reaches all four, none is reported shed.
TEST(LocalPlaneTest, MixedGroupIgnoresShedClaimsFromAMemberThatIsNobodysParent) { run_mixed_group("local-1"); }

}  // namespace
}  // namespace paramcast
