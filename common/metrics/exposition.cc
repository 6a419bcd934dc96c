#include "common/metrics/exposition.h"

#include <charconv>
#include <cmath>
#include <cstdio>

namespace paramcast::metrics {

namespace {

std::string number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.0f", v);
    return buf;
  }
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);  // the shortest form that reads back: 0.05, not 0.05000000000000000277
  return std::string(buf, r.ptr);
}

void labels_text(std::string& out, const Labels& labels) {
  if (labels.empty()) return;
  out += '{';
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i) out += ',';
    out += labels[i].first;
    out += "=\"";
    out += escape_label_value(labels[i].second);
    out += '"';
  }
  out += '}';
}

}  // namespace

std::string escape_label_value(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

void Exposition::family(std::string_view name, std::string_view type, std::string_view help) {
  text_ += "# HELP ";
  text_ += name;
  text_ += ' ';
  for (char c : help) text_ += c == '\n' ? ' ' : c;  // help is ours; kept to one line anyway
  text_ += "\n# TYPE ";
  text_ += name;
  text_ += ' ';
  text_ += type;
  text_ += '\n';
}

void Exposition::sample(std::string_view name, const Labels& labels, double value) {
  text_ += name;
  labels_text(text_, labels);
  text_ += ' ';
  text_ += number(value);
  text_ += '\n';
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::write(Exposition& out, const std::string& name, const Labels& labels) const {
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i];
    Labels l = labels;
    l.emplace_back("le", i < bounds_.size() ? number(bounds_[i]) : "+Inf");
    out.sample(name + "_bucket", l, static_cast<double>(cumulative));
  }
  out.sample(name + "_sum", labels, sum_);
  out.sample(name + "_count", labels, static_cast<double>(count_));
}

// Update durations: from a small model on loopback (milliseconds) to a
// large one across nodes (minutes).
namespace {
const std::vector<double> kSecondsBounds = {0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};
}  // namespace

UpdateCounters::UpdateCounters() : duration_(kSecondsBounds), data_(kSecondsBounds), apply_(kSecondsBounds) {}

void UpdateCounters::record(const Status& status, double seconds, uint64_t bytes, uint64_t wire_bytes,
                            double data_seconds, double apply_seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  ++results_[status.ok() ? std::string("ok") : std::string(code_name(status.code()))];
  duration_.observe(seconds);
  if (status.ok() && data_seconds > 0) {
    data_.observe(data_seconds);
    apply_.observe(apply_seconds);
  }
  if (status.ok()) {
    bytes_ += bytes;
    last_gbps_ = seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0;
  }
  wire_bytes_ += wire_bytes;
}

double UpdateCounters::last_gbps() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_gbps_;
}

void UpdateCounters::write(Exposition& out, const std::string& prefix, const Labels& labels) const {
  std::lock_guard<std::mutex> lock(mu_);
  out.family(prefix + "_updates_total", "counter", "Updates by result: ok, or the error code that ended them.");
  if (results_.empty()) {  // the family is there from the start, at 0
    Labels l = labels;
    l.emplace_back("result", "ok");
    out.sample(prefix + "_updates_total", l, 0);
  }
  for (const auto& [result, n] : results_) {
    Labels l = labels;
    l.emplace_back("result", result);
    out.sample(prefix + "_updates_total", l, static_cast<double>(n));
  }
  out.family(prefix + "_update_duration_seconds", "histogram", "Wall time of each update, plan to applied.");
  duration_.write(out, prefix + "_update_duration_seconds", labels);
  out.family(prefix + "_bytes_total", "counter", "Tensor bytes of the updates that succeeded.");
  out.sample(prefix + "_bytes_total", labels, static_cast<double>(bytes_));
  if (prefix == "paramcast") {  // what crossed the wire is the publisher's figure (deltas: far less)
    out.family(prefix + "_wire_bytes_total", "counter", "Bytes that crossed the data plane, encodings included.");
    out.sample(prefix + "_wire_bytes_total", labels, static_cast<double>(wire_bytes_));
    out.family(prefix + "_last_update_gbps", "gauge", "Tensor bytes per second of the last successful update, in GB/s.");
    out.sample(prefix + "_last_update_gbps", labels, last_gbps_);
    out.family(prefix + "_update_data_plane_seconds", "histogram",
               "Of each successful update's duration: the data plane, the publisher's first byte to its last.");
    data_.write(out, prefix + "_update_data_plane_seconds", labels);
    out.family(prefix + "_update_apply_seconds", "histogram",
               "Of each successful update's duration: from the data plane's end to the last Applied (the engines' "
               "checks and on_update_end).");
    apply_.write(out, prefix + "_update_apply_seconds", labels);
  }
}

}  // namespace paramcast::metrics
