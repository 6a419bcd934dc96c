#include "common/config.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace paramcast {
namespace {

TEST(ConfigTest, EveryDeploymentFileLoads) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(PARAMCAST_SOURCE_DIR) + "/deploy")) {
    if (e.path().extension() != ".yaml") continue;
    auto c = load_config_file(e.path().string());
    EXPECT_TRUE(c.ok()) << e.path() << ": " << c.status().to_string();
    ++n;
  }
  EXPECT_GE(n, 3) << "deploy/ should hold the local, 8-GPU and multi-node deployments";
}

TEST(ConfigTest, DefaultsAndValues) {
  auto c = load_config_string(R"(
control:
  endpoint: tcp://127.0.0.1:*
  heartbeat_interval: 100ms
  heartbeat_timeout: 2s
data_plane:
  bucket_size: 1GiB
  checksum: none
publisher:
  subscribers: [a, b, c]
  on_member_loss: continue
  reuse_validated_plan: false
subscriber:
  devices: [cpu, cpu, cpu]
)");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->control.heartbeat_interval, std::chrono::milliseconds(100));
  EXPECT_EQ(c->control.heartbeat_timeout, std::chrono::milliseconds(2000));
  EXPECT_EQ(c->control.join_timeout, std::chrono::milliseconds(60000));  // default
  EXPECT_EQ(c->data_plane.bucket_bytes, 1ull << 30);
  EXPECT_EQ(c->data_plane.checksum, Checksum::kNone);
  EXPECT_EQ(c->publisher.subscriber_ids, (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(c->expected_count(), 3);
  EXPECT_EQ(c->publisher.on_member_loss, MemberLossPolicy::kContinue);
  EXPECT_FALSE(c->publisher.reuse_validated_plan);
  EXPECT_EQ(c->worker_ids(), (std::vector<std::string>{"a", "b", "c"}));
}

TEST(ConfigTest, CountGivesGeneratedIds) {
  auto c = load_config_string("publisher:\n  subscribers: 3\n");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->worker_ids(), (std::vector<std::string>{"worker-1", "worker-2", "worker-3"}));
}

TEST(ConfigTest, EmptyFileIsAllDefaults) {
  auto c = load_config_string("");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->data_plane.bucket_bytes, 256ull << 20);
}

TEST(ConfigTest, WholeMillisecondsInAnyUnitAreAccepted) {
  auto c = load_config_string("control:\n  heartbeat_interval: 250000us\n  heartbeat_timeout: 3000000000ns\n");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->control.heartbeat_interval, std::chrono::milliseconds(250));
  EXPECT_EQ(c->control.heartbeat_timeout, std::chrono::milliseconds(3000));
}

// data_plane.stall_timeout bounds a link without progress (default 30 s);
// the old key `timeout` is still read, as that.
TEST(ConfigTest, StallTimeoutAndItsOldName) {
  auto d = load_config_string("");
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->data_plane.stall_timeout, std::chrono::seconds(30));
  auto c = load_config_string("data_plane:\n  stall_timeout: 4s\n");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->data_plane.stall_timeout, std::chrono::seconds(4));
  auto old = load_config_string("data_plane:\n  timeout: 90s\n");
  ASSERT_TRUE(old.ok()) << old.status().to_string();
  EXPECT_EQ(old->data_plane.stall_timeout, std::chrono::seconds(90));
}

// publisher.apply_timeout: auto (0) by default and when said; a duration fixes it.
TEST(ConfigTest, ApplyTimeoutIsAutoUnlessADurationIsGiven) {
  auto d = load_config_string("");
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->publisher.apply_timeout, std::chrono::milliseconds(0));
  auto a = load_config_string("publisher:\n  apply_timeout: auto\n");
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_EQ(a->publisher.apply_timeout, std::chrono::milliseconds(0));
  auto f = load_config_string("publisher:\n  apply_timeout: 90s\n");
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->publisher.apply_timeout, std::chrono::seconds(90));
}

TEST(ConfigTest, MissingFileNamesIt) {
  auto c = load_config_file("/nonexistent/paramcast.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("/nonexistent/paramcast.yaml"), std::string::npos);
}

struct BadCase {
  const char* name;
  const char* yaml;
  const char* expected;  // substring of the error, including file:line:col
};

class BadConfigTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadConfigTest, GivesOneClearError) {
  auto c = load_config_string(GetParam().yaml, "bad.yaml");
  ASSERT_FALSE(c.ok()) << "accepted: " << GetParam().yaml;
  EXPECT_EQ(c.status().code(), Code::kInvalidArgument);
  EXPECT_NE(c.status().message().find(GetParam().expected), std::string::npos)
      << "message: " << c.status().message() << "\nwanted: " << GetParam().expected;
}

INSTANTIATE_TEST_SUITE_P(
    Table, BadConfigTest,
    ::testing::Values(
        BadCase{"unknown_top_key", "contrl:\n  endpoint: tcp://a:1\n", "bad.yaml:1:1: key 'contrl': unknown key"},
        BadCase{"unknown_nested_key", "control:\n  heartbeat_intervl: 1s\n",
                "bad.yaml:2:3: key 'control.heartbeat_intervl': unknown key"},
        BadCase{"bad_duration", "control:\n  heartbeat_interval: 5 parsecs\n",
                "bad.yaml:2:23: key 'control.heartbeat_interval': bad value '5 parsecs': expected a duration"},
        BadCase{"duration_without_unit", "control:\n  join_timeout: 30\n",
                "key 'control.join_timeout': bad value '30': expected a duration"},
        BadCase{"zero_duration", "control:\n  heartbeat_timeout: 0s\n", "expected a positive duration"},
        BadCase{"zero_apply_timeout", "publisher:\n  apply_timeout: 0s\n",
                "key 'publisher.apply_timeout': bad value '0s': expected a positive duration"},
        BadCase{"timeout_not_above_interval", "control:\n  heartbeat_interval: 2s\n  heartbeat_timeout: 1s\n",
                "key 'control.heartbeat_timeout': must be longer than heartbeat_interval"},
        BadCase{"bad_size", "data_plane:\n  bucket_size: 12 parsecs\n",
                "bad.yaml:2:16: key 'data_plane.bucket_size': bad value '12 parsecs': expected a size"},
        BadCase{"size_too_small", "data_plane:\n  bucket_size: 16\n", "must be at least 4096 bytes"},
        BadCase{"bad_backend", "data_plane:\n  backend: mpi\n",
                "key 'data_plane.backend': bad value 'mpi': expected one of gloo, nccl"},
        BadCase{"bad_checksum", "data_plane:\n  checksum: md5\n", "expected one of none, xxh64"},
        BadCase{"bad_endpoint", "control:\n  endpoint: http://x\n", "expected tcp://HOST:PORT"},
        BadCase{"negative_count", "publisher:\n  subscribers: -3\n", "expected an integer in [1, 4096]"},
        BadCase{"transform_bad_fp8", "publisher:\n  transforms:\n    - {match: \"*\", fp8: mxfp4}\n",
                "bad.yaml:3:25: key 'publisher.transforms[0].fp8': bad value 'mxfp4': expected one of block, channel, tensor"},
        BadCase{"transform_two_kinds", "publisher:\n  transforms:\n    - {match: \"*\", fp8: block, cast: bf16}\n",
                "bad.yaml:3:7: key 'publisher.transforms[0]': a rule gives exactly one of cast, fp8 or keep: true"},
        BadCase{"transform_no_match", "publisher:\n  transforms:\n    - {cast: bf16}\n",
                "bad.yaml:3:7: key 'publisher.transforms[0]': a rule needs match"},
        BadCase{"transform_bad_cast", "publisher:\n  transforms:\n    - {match: x, cast: int8}\n",
                "expected one of bf16, fp16, fp32"},

        BadCase{"duplicate_id", "publisher:\n  subscribers: [a, b, a]\n",
                "bad.yaml:2:23: key 'publisher.subscribers[2]': duplicate worker id 'a'"},
        BadCase{"bad_id_chars", "publisher:\n  subscribers: [\"a b\"]\n", "bad worker id 'a b'"},
        BadCase{"bad_device", "publisher:\n  device: tpu:0\n",
                "key 'publisher.device': bad value 'tpu:0': expected cpu, cuda or cuda:N"},
        BadCase{"bad_policy", "publisher:\n  on_member_loss: ignore\n", "expected one of fail, continue"},
        BadCase{"bad_slow_policy", "publisher:\n  on_slow_member: drop\n", "expected one of wait, shed"},
        BadCase{"shed_without_floor", "publisher:\n  on_slow_member: shed\n",
                "bad.yaml:2:19: key 'publisher.on_slow_member': shed needs publisher.slow_member_floor"},
        BadCase{"shed_with_nccl",
                "publisher:\n  device: cuda:0\n  on_slow_member: shed\n  slow_member_floor: 8MiB\n"
                "subscriber:\n  device: cuda:0\ndata_plane:\n  backend: nccl\n",
                "key 'publisher.on_slow_member': shed needs backend gloo"},
        BadCase{"bad_bool", "publisher:\n  reuse_validated_plan: sometimes\n",
                "bad.yaml:2:25: key 'publisher.reuse_validated_plan': bad value 'sometimes': expected true or false"},
        BadCase{"device_count_mismatch", "publisher:\n  subscribers: 3\nsubscriber:\n  devices: [cpu, cpu]\n",
                "lists 2 devices for 3 subscribers"},
        BadCase{"gloo_with_cuda", "publisher:\n  device: cuda:0\n", "backend gloo moves host memory"},
        BadCase{"nccl_without_cuda", "data_plane:\n  backend: nccl\n", "backend nccl needs cuda devices"},
        BadCase{"bad_dtype", "trainer:\n  dtype: F12\n", "bad value 'F12': expected a safetensors dtype"},
        BadCase{"bad_log_level", "logging:\n  level: loud\n", "expected one of debug, info, warn, error, off"},
        BadCase{"section_not_map", "control: 5\n", "key 'control': expected a mapping, got a scalar"},
        BadCase{"list_for_scalar", "control:\n  endpoint: [a, b]\n", "expected an endpoint like tcp://host:port, got a list"},
        BadCase{"yaml_syntax", "control:\n  endpoint: [unclosed\n", "bad.yaml:3:1: YAML syntax error"},
        BadCase{"bad_bool_updates", "trainer:\n  updates: many\n", "bad value 'many': expected an integer"},
        BadCase{"sub_millisecond_duration", "control:\n  heartbeat_interval: 500us\n",
                "bad.yaml:2:23: key 'control.heartbeat_interval': bad value '500us': not a whole number of milliseconds"},
        BadCase{"fractional_millisecond_duration", "data_plane:\n  timeout: 1500500us\n",
                "key 'data_plane.timeout': bad value '1500500us': not a whole number of milliseconds"},
        BadCase{"stall_timeout_and_old_name", "data_plane:\n  stall_timeout: 5s\n  timeout: 9s\n",
                "bad.yaml:3:12: key 'data_plane.timeout': old name of data_plane.stall_timeout, which is given too"},
        BadCase{"zero_stall_timeout", "data_plane:\n  stall_timeout: 0s\n",
                "key 'data_plane.stall_timeout': bad value '0s': expected a positive duration"},
        BadCase{"zero_update_timeout", "publisher:\n  update_timeout: 0ms\n",
                "key 'publisher.update_timeout': bad value '0ms': expected a positive duration"},
        BadCase{"key_given_twice", "control:\n  heartbeat_interval: 1s\n  join_timeout: 5s\n  heartbeat_interval: 2s\n",
                "bad.yaml:4:3: key 'control.heartbeat_interval': given twice (first at line 2, again at line 4)"},
        BadCase{"section_given_twice", "control:\n  join_timeout: 5s\ndata_plane:\n  timeout: 9s\ncontrol:\n  join_timeout: 6s\n",
                "bad.yaml:5:1: key 'control': given twice (first at line 1, again at line 5)"}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace paramcast
