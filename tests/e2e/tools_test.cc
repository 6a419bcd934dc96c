// The command-line tools, run as real processes: every one answers --help / -h
// with its usage on stdout (exit 0), and an unknown flag with one error line
// and the usage on stderr (exit 2); paramcast-trainer prints membership events
// as they happen, also while an update is blocked.
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>

#include "tests/support/cluster.h"
#include "tests/support/process.h"

namespace paramcast {
namespace {

using test::Process;
using std::chrono::seconds;

struct ToolRun {
  int code = -1;
  std::string out;  // the stream asked for
};

enum class Stream { kStdout, kStderr };

// Runs `tool args...` to completion, keeping only one of its streams.
ToolRun run_tool(const std::string& tool, const std::vector<std::string>& args, Stream keep) {
  // sh keeps one stream on the pipe that Process reads and sends the other to /dev/null.
  std::vector<std::string> argv = {"-c", keep == Stream::kStdout ? "exec \"$0\" \"$@\" 2>/dev/null"
                                                                 : "exec \"$0\" \"$@\" 2>&1 >/dev/null",
                                   test::binary(tool)};
  argv.insert(argv.end(), args.begin(), args.end());
  auto p = Process::start("/bin/sh", argv);
  ToolRun r;
  if (!p) {
    ADD_FAILURE() << "cannot start " << tool;
    return r;
  }
  auto code = p->wait_for(seconds(60));
  EXPECT_TRUE(code.has_value()) << tool << " did not exit:\n" << p->output();
  r.code = code.value_or(-1);
  r.out = p->output();
  return r;
}

struct ToolCase {
  std::string label;               // the test's name
  std::string binary;              // in build/bin
  std::vector<std::string> args;   // before the flag under test (a subcommand)
  std::string usage;               // how its usage starts
  std::string name;                // how its error lines start
  bool bench = false;              // built only with PARAMCAST_BUILD_BENCH
};

// Names the case in test output (and in the ctest names) by its label.
void PrintTo(const ToolCase& c, std::ostream* os) { *os << c.label; }

std::string describe(const ToolCase& c) {
  std::string s = c.binary;
  for (const auto& a : c.args) s += " " + a;
  return s;
}

class ToolsTest : public ::testing::TestWithParam<ToolCase> {
 protected:
  void SetUp() override {
#ifndef PARAMCAST_TEST_BENCH_TOOLS
    if (GetParam().bench) GTEST_SKIP() << GetParam().binary << " is not built (PARAMCAST_BUILD_BENCH=OFF)";
#endif
  }
  std::vector<std::string> args_with(const std::string& flag) {
    auto a = GetParam().args;
    a.push_back(flag);
    return a;
  }
};

TEST_P(ToolsTest, HelpPrintsUsageOnStdoutAndExitsZero) {
  const ToolCase& c = GetParam();
  for (const char* flag : {"--help", "-h"}) {
    ToolRun out = run_tool(c.binary, args_with(flag), Stream::kStdout);
    EXPECT_EQ(out.code, 0) << describe(c) << " " << flag << ":\n" << out.out;
    EXPECT_EQ(out.out.rfind(c.usage, 0), 0u) << describe(c) << " " << flag << " printed on stdout:\n" << out.out;
    EXPECT_NE(out.out.find("-h, --help"), std::string::npos) << out.out;
    ToolRun err = run_tool(c.binary, args_with(flag), Stream::kStderr);
    EXPECT_EQ(err.code, 0);
    EXPECT_EQ(err.out, "") << describe(c) << " " << flag << " printed on stderr";
  }
}

TEST_P(ToolsTest, UnknownFlagIsNamedOnStderrWithTheUsageAndExitsTwo) {
  const ToolCase& c = GetParam();
  ToolRun err = run_tool(c.binary, args_with("--no-such-flag"), Stream::kStderr);
  EXPECT_EQ(err.code, 2) << describe(c) << ":\n" << err.out;
  const std::string first_line = err.out.substr(0, err.out.find('\n'));
  EXPECT_EQ(first_line, c.name + ": unknown flag --no-such-flag") << err.out;
  EXPECT_EQ(err.out.find(c.usage), first_line.size() + 1) << "the usage follows the error line:\n" << err.out;
  ToolRun out = run_tool(c.binary, args_with("--no-such-flag"), Stream::kStdout);
  EXPECT_EQ(out.code, 2);
  EXPECT_EQ(out.out, "") << describe(c) << " printed on stdout";
}

INSTANTIATE_TEST_SUITE_P(
    Tools, ToolsTest,
    ::testing::Values(
        ToolCase{"paramcast", "paramcast", {}, "usage: paramcast COMMAND", "paramcast"},
        ToolCase{"paramcast_launch", "paramcast", {"launch"}, "usage: paramcast launch FILE.yaml", "paramcast launch"},
        ToolCase{"paramcast_status", "paramcast", {"status"}, "usage: paramcast status [tcp://HOST:PORT]",
                 "paramcast status"},
        ToolCase{"paramcast_keygen", "paramcast", {"keygen"}, "usage: paramcast keygen NAME...", "paramcast keygen"},
        ToolCase{"paramcast_trainer", "paramcast-trainer", {}, "usage: paramcast-trainer --config FILE.yaml",
                 "paramcast-trainer"},
        ToolCase{"paramcast_worker", "paramcast-worker", {}, "usage: paramcast-worker --config FILE.yaml",
                 "paramcast-worker"},
        ToolCase{"paramcast_bench", "paramcast-bench", {}, "usage: paramcast-bench [--backend gloo|nccl|shm]",
                 "paramcast-bench", true},
        ToolCase{"gloo_pieces_probe", "gloo-pieces-probe", {}, "usage: gloo-pieces-probe [PIECES=10000]",
                 "gloo-pieces-probe", true}),
    [](const ::testing::TestParamInfo<ToolCase>& info) { return info.param.label; });

TEST(ToolsCliTest, ParamcastNamesAMissingOrUnknownCommand) {
  ToolRun none = run_tool("paramcast", {}, Stream::kStderr);
  EXPECT_EQ(none.code, 2);
  EXPECT_EQ(none.out.rfind("paramcast: missing COMMAND\nusage: paramcast COMMAND", 0), 0u) << none.out;
  ToolRun bad = run_tool("paramcast", {"frobnicate"}, Stream::kStderr);
  EXPECT_EQ(bad.code, 2);
  EXPECT_EQ(bad.out.rfind("paramcast: unknown command 'frobnicate'\nusage: paramcast COMMAND", 0), 0u) << bad.out;
  // A flag that only another command knows is unknown to this one.
  ToolRun other = run_tool("paramcast", {"launch", "x.yaml", "--json"}, Stream::kStderr);
  EXPECT_EQ(other.code, 2);
  EXPECT_EQ(other.out.rfind("paramcast launch: unknown flag --json\n", 0), 0u) << other.out;
}

TEST(ToolsCliTest, ValidFlagsKeepWorking) {
  // --name=value, --name value, a boolean flag, and flags before the command.
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"status", "tcp://127.0.0.1:9", "--json", "--timeout=300ms"},
        std::vector<std::string>{"--json", "status", "--timeout", "300ms", "tcp://127.0.0.1:9"}}) {
    ToolRun r = run_tool("paramcast", args, Stream::kStderr);
    EXPECT_EQ(r.code, 1) << r.out;  // nobody answers on port 9
    EXPECT_EQ(r.out, "paramcast status: no answer from tcp://127.0.0.1:9 within 300.000 ms\n");
  }
  // Missing required flags and values are errors too, with the usage.
  ToolRun no_config = run_tool("paramcast-trainer", {"--updates", "1"}, Stream::kStderr);
  EXPECT_EQ(no_config.code, 2);
  EXPECT_EQ(no_config.out.rfind("paramcast-trainer: --config is required\nusage: paramcast-trainer", 0), 0u)
      << no_config.out;
  ToolRun no_value = run_tool("paramcast-worker", {"--id", "w", "--config"}, Stream::kStderr);
  EXPECT_EQ(no_value.code, 2);
  EXPECT_EQ(no_value.out.rfind("paramcast-worker: flag --config needs a value\nusage: paramcast-worker", 0), 0u)
      << no_value.out;
}

// paramcast-trainer prints "member ID: EVENT (DETAIL)" as events happen, not
// only after the next weight_update returns. The update stays blocked for as
// long as the test needs: its only group member, worker-1, wedges after
// bucket 1 (fault hook) while its control thread keeps heartbeating, and the
// data-plane and update timeouts are far away. worker-2 joins outside that
// group (the trainer started without it), so its join and its loss do not end
// the update; both must be printed while it is still blocked.
TEST(ToolsCliTest, TrainerPrintsMemberEventsWhileAnUpdateIsBlocked) {
  const std::string dir = test::make_temp_dir("paramcast-tools-test");
  ASSERT_FALSE(dir.empty());
  std::string yaml = test::test_config_yaml(2, "  on_missing_at_start: start_with_present\n  update_timeout: 600s\n");
  auto replace = [&yaml](const std::string& from, const std::string& to) {
    const auto at = yaml.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    yaml.replace(at, from.size(), to);
  };
  replace("  join_timeout: 30s\n", "  join_timeout: 10s\n");  // then start with worker-1 alone
  replace("  stall_timeout: 20s\n", "  stall_timeout: 600s\n");  // data plane: the stall must not time out
  const std::string config = test::write_file(dir, "deploy.yaml", yaml);
  const std::string endpoint_file = dir + "/endpoint";

  auto trainer = Process::start(test::binary("paramcast-trainer"),
                                {"--config", config, "--endpoint-file", endpoint_file, "--updates", "1"});
  ASSERT_TRUE(trainer);
  ASSERT_TRUE(trainer->wait_for_output("control endpoint", seconds(60))) << trainer->output();
  std::string endpoint;
  std::ifstream(endpoint_file) >> endpoint;
  ASSERT_FALSE(endpoint.empty());
  auto worker = [&](const std::string& id, const std::vector<std::string>& env) {
    return Process::start(test::binary("paramcast-worker"),
                          {"--config", config, "--id", id, "--endpoint", endpoint, "--updates", "0"}, env);
  };
  auto w1 = worker("worker-1", {"PARAMCAST_FAULT_STALL_AFTER_BUCKET=1"});
  ASSERT_TRUE(w1);
  // Printed while the trainer still waits in start() for worker-2.
  ASSERT_TRUE(trainer->wait_for_output("member worker-1: joined (", seconds(60))) << trainer->output();
  ASSERT_TRUE(w1->wait_for_output("stalling after bucket 1 of v1", seconds(120))) << w1->output();

  auto w2 = worker("worker-2", {});
  ASSERT_TRUE(w2);
  ASSERT_TRUE(trainer->wait_for_output("member worker-2: joined (", seconds(60))) << trainer->output();
  w2->kill(SIGKILL);
  ASSERT_TRUE(trainer->wait_for_output("member worker-2: lost (silent for ", seconds(60))) << trainer->output();
  {
    const std::string out = trainer->output();
    EXPECT_EQ(out.find("update v1"), std::string::npos) << "v1 was to stay blocked:\n" << out;
    EXPECT_TRUE(trainer->running()) << out;
  }

  // Unblock: losing worker-1 fails v1, and the trainer exits 1.
  w1->kill(SIGKILL);
  auto code = trainer->wait_for(seconds(120));
  ASSERT_TRUE(code.has_value()) << "the trainer did not exit:\n" << trainer->output();
  const std::string out = trainer->output();
  EXPECT_EQ(*code, 1) << out;
  const auto joined = out.find("member worker-2: joined (");
  const auto lost = out.find("member worker-2: lost (");
  const auto update = out.find("update v1 FAILED: ");
  ASSERT_NE(update, std::string::npos) << out;
  EXPECT_LT(joined, lost) << out;
  EXPECT_LT(lost, update) << out;
  EXPECT_NE(out.find("member worker-1: lost ("), std::string::npos) << out;
  EXPECT_NE(out.find("paramcast-trainer: 1 updates, 1 failed"), std::string::npos) << out;
  test::remove_tree(dir);
}

}  // namespace
}  // namespace paramcast
