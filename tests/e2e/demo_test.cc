// The README's demo, as CI runs it: `paramcast launch deploy/local-cpu.yaml`
// starts 1 trainer and 7 workers; every worker verifies every byte.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace paramcast
