// What an update reports, with real processes. A many-sender update (rank 0
// and rank 1 in this process, engines as paramcast-worker processes) whose
// engines are gone fails as a single sender's does with no subscriber
// (UNAVAILABLE), for every trainer rank, and the next engine to join gets
// the next update. paramcast-trainer's line for an update labels what
// crossed the data plane per engine and in total.
#include <gtest/gtest.h>

#include <signal.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <thread>

#include "tests/e2e/sharded_fixture.h"
#include "tests/support/process.h"

namespace paramcast {
namespace {

using namespace std::chrono_literals;
using sharded_test::ShardedUpdateTest;

class ShardedNoEngineTest : public ShardedUpdateTest {
 protected:
  void SetUp() override { start_cluster("  ranks: 2\n  on_member_loss: continue\n"); }

  // Waits for an event of one of `kinds` for `id`; the events polled on the
  // way are kept for the next wait (another member's may come first).
  bool wait_any(const std::string& id, std::initializer_list<MemberEvent::Kind> kinds) {
    auto match = [&](const MemberEvent& e) {
      return e.worker_id == id && std::find(kinds.begin(), kinds.end(), e.kind) != kinds.end();
    };
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (true) {
      if (auto it = std::find_if(seen_.begin(), seen_.end(), match); it != seen_.end()) {
        seen_.erase(it);
        return true;
      }
      if (std::chrono::steady_clock::now() >= deadline) return false;
      while (auto e = pub_->poll_event()) seen_.push_back(*e);
      std::this_thread::sleep_for(5ms);
    }
  }
  std::vector<MemberEvent> seen_;
};

// Both engines leave (with on_member_loss: continue): the update that
// follows reached nobody and was reported as success ("ok ... dense (no
// engine in the group) ... to 1 members"), update after update.
TEST_F(ShardedNoEngineTest, AnUpdateThatReachesNoEngineFailsAsASingleSendersWithNoSubscriber) {
  auto [r0, r1] = publish_both(1);
  ASSERT_TRUE(r0.ok()) << r0.status.to_string() << outputs();
  ASSERT_TRUE(r1.ok()) << r1.status.to_string();
  for (const char* id : {"worker-1", "worker-2"}) {
    ASSERT_TRUE(workers_[id]->wait_for_output(std::string(id) + ": v1 verified", 30s)) << outputs();
    workers_[id]->kill(SIGKILL);
  }
  for (const char* id : {"worker-1", "worker-2"})
    ASSERT_TRUE(wait_any(id, {MemberEvent::Kind::kLost, MemberEvent::Kind::kLeft})) << id;
  for (uint64_t v = 2; v <= 3; ++v) {
    auto [n0, n1] = publish_both(v);
    for (const UpdateResult* r : {&n0, &n1}) {
      ASSERT_FALSE(r->ok()) << "v" << v << " reached no engine, yet succeeded";
      EXPECT_NE(r->status.message().find("no engine in the group"), std::string::npos) << r->status.to_string();
    }
    // Rank 0's call fails UNAVAILABLE (a single sender's with no live
    // subscriber: "no live subscriber to form a group with"); rank 1's ends
    // as on any refusal of rank 0's, ABORTED with rank 0's reason.
    EXPECT_EQ(n0.status.code(), Code::kUnavailable) << n0.status.to_string();
    EXPECT_NE(n0.status.message().find("absent: worker-1, worker-2"), std::string::npos) << n0.status.to_string();
    EXPECT_TRUE(n0.subscribers.empty());
  }
  // An engine that joins gets the next update, from both ranks.
  seen_.clear();  // worker-1's first join, polled on the way to its loss
  spawn_worker("worker-1");
  ASSERT_TRUE(wait_any("worker-1", {MemberEvent::Kind::kJoined, MemberEvent::Kind::kRejoined})) << outputs();
  auto [a0, a1] = publish_both(4);
  ASSERT_TRUE(a0.ok()) << a0.status.to_string() << outputs();
  ASSERT_TRUE(a1.ok()) << a1.status.to_string();
  EXPECT_TRUE(workers_["worker-1"]->wait_for_output("worker-1: v4 verified", 30s)) << outputs();
}

// A kept plan while the callers' shards move to new buffers each step (the
// last step's bytes still alive where they were): every trainer rank reads
// each piece where its shard is now, not where its buffer index of the kept
// plan found it, and both engines verify every step.
TEST_F(ShardedUpdateTest, ShardsAtNewAddressesUnderAKeptPlanAreReadWhereTheyAreNow) {
  fresh_addresses_ = true;
  for (uint64_t v = 1; v <= 4; ++v) {
    auto [r0, r1] = publish_both(v);
    ASSERT_TRUE(r0.ok()) << "v" << v << ": " << r0.status.to_string() << outputs();
    ASSERT_TRUE(r1.ok()) << "v" << v << ": " << r1.status.to_string();
    EXPECT_EQ(r0.plan_kept, v > 1) << "v" << v << ": the same parts, Wants and group after the first";
    for (const std::string id : {"worker-1", "worker-2"})
      ASSERT_TRUE(workers_[id]->wait_for_output(id + ": v" + std::to_string(v) + " verified", 30s)) << outputs();
  }
}

// A size as format_bytes prints it ("7.90 MiB"), in bytes.
double parse_size(const std::string& text) {
  std::istringstream in(text);
  double n = 0;
  std::string unit;
  in >> n >> unit;
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  for (int i = 0; i < 4; ++i)
    if (unit == units[i]) return n * static_cast<double>(uint64_t{1} << (10 * i));
  ADD_FAILURE() << "not a size: '" << text << "'";
  return 0;
}

// paramcast-trainer on `ranks` ranks (processes) and two engines, deltas
// on, three updates in which a few elements change: rank 0's output.
std::string run_trainer_with_deltas(const std::string& dir, int ranks) {
  std::string yaml = test::test_config_yaml(2, "  ranks: " + std::to_string(ranks) + "\n  delta: auto\n");
  yaml.replace(yaml.find("  updates: 3\n"), 13, "  updates: 3\n  changes: uneven\n");
  const std::string path = test::write_file(dir, "deploy.yaml", yaml);
  auto rank0 = test::Process::start(test::binary("paramcast-trainer"),
                                    {"--config", path, "--endpoint-file", dir + "/endpoint"});
  const std::string endpoint = test::read_when_written(dir + "/endpoint");
  EXPECT_FALSE(endpoint.empty()) << rank0->output();
  std::vector<std::unique_ptr<test::Process>> others;
  for (int r = 1; r < ranks; ++r)
    others.push_back(test::Process::start(test::binary("paramcast-trainer"),
                                          {"--config", path, "--rank", std::to_string(r), "--endpoint", endpoint}));
  for (const char* id : {"worker-1", "worker-2"})
    others.push_back(test::Process::start(test::binary("paramcast-worker"),
                                          {"--config", path, "--id", id, "--endpoint", endpoint, "--updates", "3"}));
  EXPECT_EQ(rank0->wait_for(120s), 0) << rank0->output();
  for (auto& p : others) EXPECT_EQ(p->wait_for(60s), 0) << p->output();
  return rank0->output();
}

// The line of an update that went as a delta: "... ; on the wire: <what>".
std::string wire_of_a_delta(const std::string& out) {
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);)
    if (line.find(" as a delta") != std::string::npos) {
      const auto at = line.find("; on the wire: ");
      EXPECT_NE(at, std::string::npos) << line;
      if (at == std::string::npos) return "";
      const auto end = line.find(';', at + 1);
      return line.substr(at + 15, end == std::string::npos ? std::string::npos : end - at - 15);
    }
  ADD_FAILURE() << "no update went as a delta:\n" << out;
  return "";
}

// Two engines of a many-sender job: each one's wire bytes, named, and their
// total, labelled; trainer ranks (which receive nothing) are not listed.
// (Before: "as a delta of 15.79 MiB" for a 7.90 MiB update, the sum over
// the engines, unlabelled.)
TEST(UpdateLineTest, AManySenderDeltaListsEachEnginesWireBytesAndTheirTotal) {
  const std::string dir = test::make_temp_dir("paramcast-wire");
  const std::string wire = wire_of_a_delta(run_trainer_with_deltas(dir, 2));
  test::remove_tree(dir);
  // "worker-1 1.02 MiB, worker-2 1.01 MiB, 2.03 MiB in total"
  std::vector<std::string> parts;
  std::istringstream in(wire);
  for (std::string part; std::getline(in, part, ',');) parts.push_back(part.substr(part.find_first_not_of(' ')));
  ASSERT_EQ(parts.size(), 3u) << wire;
  double sum = 0;
  for (int i = 0; i < 2; ++i) {
    const std::string id = "worker-" + std::to_string(i + 1) + " ";
    ASSERT_EQ(parts[i].rfind(id, 0), 0u) << wire;
    const double each = parse_size(parts[i].substr(id.size()));
    EXPECT_GT(each, 0) << wire;
    sum += each;
  }
  ASSERT_NE(parts[2].find(" in total"), std::string::npos) << wire;
  const double total = parse_size(parts[2].substr(0, parts[2].find(" in total")));
  EXPECT_NEAR(total, sum, 0.01 * sum + 16 * 1024) << wire;  // each printed to two decimals
  EXPECT_EQ(wire.find("trainer-"), std::string::npos) << wire;
}

// One sender: one copy of the encoded buckets to each subscriber, and the
// total, labelled. (Before: "as a delta of 1.02 MiB", unlabelled.)
TEST(UpdateLineTest, ABroadcastDeltaSaysWhatEachSubscriberReceivedAndTheTotal) {
  const std::string dir = test::make_temp_dir("paramcast-wire");
  const std::string wire = wire_of_a_delta(run_trainer_with_deltas(dir, 1));
  test::remove_tree(dir);
  // "1.02 MiB to each of 2 subscribers, 2.03 MiB in total"
  const auto each = wire.find(" to each of 2 subscribers, ");
  ASSERT_NE(each, std::string::npos) << wire;
  const auto total_at = each + std::string(" to each of 2 subscribers, ").size();
  ASSERT_NE(wire.find(" in total", total_at), std::string::npos) << wire;
  const double one = parse_size(wire.substr(0, each));
  const double total = parse_size(wire.substr(total_at, wire.find(" in total") - total_at));
  EXPECT_GT(one, 0) << wire;
  EXPECT_NEAR(total, 2 * one, 0.01 * total + 16 * 1024) << wire;
}

}  // namespace
}  // namespace paramcast
