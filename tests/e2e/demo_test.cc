// The README's demo, as CI runs it: `paramcast launch deploy/local-cpu.yaml`
// starts 1 trainer and 7 workers; every worker verifies every byte.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "tests/support/cluster.h"
#include "tests/support/deployments.h"
#include "tests/support/process.h"

namespace paramcast {
namespace {

using test::Process;

TEST(DemoTest, LocalCpuDeploymentSucceedsAndEveryWorkerVerifies) {
  test::launch_and_expect_every_worker_verified("deploy/local-cpu.yaml");
}

TEST(DemoTest, LaunchStopsEveryRoleWhenOneFails) {
  // Workers that speak another protocol version are rejected and exit 1;
  // launch must stop the trainer (still waiting for them) and fail fast.
  auto launch = Process::start(test::binary("paramcast"),
                               {"launch", std::string(PARAMCAST_SOURCE_DIR) + "/deploy/local-cpu.yaml"},
                               {"PARAMCAST_TEST_PROTOCOL_VERSION=99"});
  auto code = launch->wait_for(std::chrono::seconds(30));
  ASSERT_TRUE(code.has_value()) << "launch did not stop:\n" << launch->output();
  EXPECT_EQ(*code, 1);
  const std::string out = launch->output();
  EXPECT_NE(out.find("failed (exit 1); stopping every role"), std::string::npos) << out;
  EXPECT_NE(out.find("FAILED"), std::string::npos) << out;
}

// A normal end, as at the end of the demo: the trainer finishes its updates
// and says Leave while a worker still runs. The worker says so at info level
// (a warning is for a publisher lost without a word), and each log line
// carries its time as ISO 8601 UTC with milliseconds.
TEST(DemoTest, AWorkerOutlivingTheTrainerLogsItsAnnouncedLeaveWithoutAWarning) {
  const std::string dir = test::make_temp_dir("paramcast-demo-test");
  ASSERT_FALSE(dir.empty());
  const std::string config = test::write_file(dir, "deploy.yaml", test::test_config_yaml(1));
  const std::string endpoint_file = dir + "/endpoint";
  auto trainer = Process::start(test::binary("paramcast-trainer"),
                                {"--config", config, "--endpoint-file", endpoint_file, "--updates", "1"});
  ASSERT_TRUE(trainer->wait_for_output("control endpoint", std::chrono::seconds(60))) << trainer->output();
  std::string endpoint;
  std::ifstream(endpoint_file) >> endpoint;
  ASSERT_FALSE(endpoint.empty());
  auto worker = Process::start(test::binary("paramcast-worker"),
                               {"--config", config, "--id", "worker-1", "--endpoint", endpoint, "--updates", "0"});
  EXPECT_EQ(trainer->wait_for(std::chrono::seconds(120)), 0) << trainer->output();
  ASSERT_TRUE(worker->wait_for_output("keeping weights (version 1, consistent)", std::chrono::seconds(30)))
      << worker->output();
  worker->kill(SIGTERM);
  worker->wait_for(std::chrono::seconds(30));
  const std::string out = worker->output();
  int logged = 0;
  for (const auto& l : test::log_lines(out)) {
    if (l.member != "worker-1") continue;
    ++logged;
    EXPECT_TRUE(l.level == 'D' || l.level == 'I') << "a normal end warns nobody: " << l.message << "\n" << out;
  }
  EXPECT_GE(logged, 3) << "joined, publisher left, keeping weights: each an ISO 8601 line:\n" << out;
  EXPECT_NE(out.find("publisher left (publisher shutting down)"), std::string::npos) << out;
  test::remove_tree(dir);
}

}  // namespace
}  // namespace paramcast
