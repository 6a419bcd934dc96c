// Prometheus text exposition (format 0.0.4): the families a /metrics page
// is made of, written by the publisher and the subscriber from their own
// state at each scrape (common/metrics/http_server.h serves the page).
//
//   Exposition e;
//   e.family("paramcast_bytes_total", "counter", "Tensor bytes of applied updates.");
//   e.sample("paramcast_bytes_total", {}, 1.5e9);
//   e.sample("paramcast_member_version", {{"worker", "worker-3"}}, 7);
//
// Label values are escaped as the format says (\\, \", \n), so a worker id
// or an error code can never break a line.
//
// The pages are rendered at each scrape by trainer_side/publisher_metrics.cc
// and inference_side/subscriber_metrics.cc from snapshots (the membership
// table, stats(), the weight state); http_server.h (MetricsServer:
// cpp-httplib on a thread of its own, /metrics only, two workers, small
// limits) serves them.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace paramcast::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;

class Exposition {
 public:
  // `type`: counter, gauge or histogram. Each family once, before its samples.
  void family(std::string_view name, std::string_view type, std::string_view help);
  void sample(std::string_view name, const Labels& labels, double value);
  const std::string& text() const { return text_; }

 private:
  std::string text_;
};

std::string escape_label_value(std::string_view value);

// A histogram with fixed upper bounds (seconds, say); + Inf is implied.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  // The _bucket, _sum and _count samples of family `name` (declared by the caller).
  void write(Exposition& out, const std::string& name, const Labels& labels) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bound, not cumulative; the last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

// What both sides count about the updates they took part in: results by
// outcome ("ok" or the error code), their durations, their bytes. Safe from
// any thread.
class UpdateCounters {
 public:
  UpdateCounters();
  // `data_seconds`, `apply_seconds`: the publisher's split of `seconds`
  // (UpdateResult); 0 where there is none (an engine's figures).
  void record(const Status& status, double seconds, uint64_t bytes, uint64_t wire_bytes, double data_seconds = 0,
              double apply_seconds = 0);
  // `prefix`: "paramcast" (publisher) or "paramcast_subscriber".
  void write(Exposition& out, const std::string& prefix, const Labels& labels) const;
  double last_gbps() const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, uint64_t> results_;
  Histogram duration_, data_, apply_;
  uint64_t bytes_ = 0, wire_bytes_ = 0;
  double last_gbps_ = 0;
};

}  // namespace paramcast::metrics
