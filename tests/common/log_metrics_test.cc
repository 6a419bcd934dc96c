// The json log format and the Prometheus exposition: what an operator's
// tools parse must hold whatever bytes a line or a label carries.
#include <gtest/gtest.h>

#include <string>

#include "common/config.h"
#include "common/log.h"
#include "common/metrics/exposition.h"

namespace paramcast {
namespace {

TEST(JsonLog, SplitsComponentAndMessage) {
  // 2026-11-25T16:01:37.123Z
  const long long ms = 1795622497123LL;
  EXPECT_EQ(json_log_line(LogLevel::kWarn, ms, "publisher: update v3 failed"),
            R"({"time":"2026-11-25T16:01:37.123Z","level":"warn","component":"publisher","message":"update v3 failed"})");
}

TEST(TextLog, TimeIsIso8601UtcWithMilliseconds) {
  // The text format's time is the json format's: one clock for both.
  const long long ms = 1795622497123LL;
  EXPECT_EQ(text_log_line(LogLevel::kWarn, ms, "publisher: update v3 failed"),
            "W 2026-11-25T16:01:37.123Z publisher: update v3 failed");
  EXPECT_EQ(text_log_line(LogLevel::kInfo, 7, "x"), "I 1970-01-01T00:00:00.007Z x");
}

TEST(JsonLog, ASubscribersLinesCarryItsWorkerId) {
  note_log_worker("engine-7");
  const std::string line = json_log_line(LogLevel::kInfo, 0, "engine-7: joined tcp://127.0.0.1:5555");
  EXPECT_NE(line.find(R"("component":"subscriber","worker":"engine-7","message":"joined tcp://127.0.0.1:5555")"),
            std::string::npos) << line;
  EXPECT_NE(line.find(R"("time":"1970-01-01T00:00:00.000Z","level":"info")"), std::string::npos) << line;
}

TEST(JsonLog, EscapesWhatALineCarries) {
  const std::string line = json_log_line(LogLevel::kError, 0, "publisher: peer said \"a\\b\"\n\x01\tend");
  EXPECT_NE(line.find(R"("message":"peer said \"a\\b\"\n\u0001\tend")"), std::string::npos) << line;
  EXPECT_EQ(line.find('\n'), std::string::npos);
}

TEST(JsonLog, ALineWithoutAComponentIsParamcasts) {
  const std::string line = json_log_line(LogLevel::kDebug, 0, "no prefix here");
  EXPECT_NE(line.find(R"("component":"paramcast","message":"no prefix here")"), std::string::npos) << line;
  const std::string odd = json_log_line(LogLevel::kDebug, 0, "two words: not a component");
  EXPECT_NE(odd.find(R"("component":"paramcast","message":"two words: not a component")"), std::string::npos) << odd;
}

TEST(JsonLog, IsAConfigChoice) {
  auto c = load_config_string("logging:\n  format: json\n");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->log_format, LogFormat::kJson);
  auto bad = load_config_string("logging:\n  format: xml\n", "x.yaml");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("logging.format"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("x.yaml:2"), std::string::npos) << bad.status().message();
}

TEST(MetricsConfig, ListenForms) {
  auto port_only = load_config_string("metrics:\n  listen: 9464\n");
  ASSERT_TRUE(port_only.ok());
  EXPECT_EQ(port_only->metrics.listen_host, "127.0.0.1");
  EXPECT_EQ(port_only->metrics.listen_port, 9464);
  auto any = load_config_string("metrics:\n  listen: 0.0.0.0:9464\n");
  ASSERT_TRUE(any.ok());
  EXPECT_EQ(any->metrics.listen_host, "0.0.0.0");
  auto v6 = load_config_string("metrics:\n  listen: '[::1]:0'\n");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->metrics.listen_host, "::1");
  EXPECT_EQ(v6->metrics.listen_port, 0);
  EXPECT_FALSE(load_config_string("").value().metrics.enabled());
  auto bad = load_config_string("metrics:\n  listen: host:70000\n", "m.yaml");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("m.yaml:2"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("metrics.listen"), std::string::npos) << bad.status().message();
}

TEST(Exposition, EscapesLabelValues) {
  metrics::Exposition e;
  e.family("x_total", "counter", "help\nsplit");
  e.sample("x_total", {{"worker", "a\"b\\c\nd"}}, 3);
  EXPECT_EQ(e.text(), "# HELP x_total help split\n# TYPE x_total counter\nx_total{worker=\"a\\\"b\\\\c\\nd\"} 3\n");
}

TEST(Exposition, HistogramIsCumulative) {
  metrics::Histogram h({1, 10});
  h.observe(0.5);
  h.observe(5);
  h.observe(50);
  metrics::Exposition e;
  h.write(e, "d", {});
  EXPECT_EQ(e.text(), "d_bucket{le=\"1\"} 1\nd_bucket{le=\"10\"} 2\nd_bucket{le=\"+Inf\"} 3\nd_sum 55.5\nd_count 3\n");
}

}  // namespace
}  // namespace paramcast
