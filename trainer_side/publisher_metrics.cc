// The publisher's Prometheus page (metrics.listen): its updates, and each
// member as the membership table last saw it. Rendered at each scrape from
// snapshots taken under their own locks; an update in flight is never held
// up by a scrape.
#include <chrono>
#include <map>
#include <set>

#include "trainer_side/publisher_impl.h"

namespace paramcast {

Status PublisherImpl::start_metrics() {
  if (!cfg_.metrics.enabled()) return Status();
  auto server = metrics::MetricsServer::start(cfg_.metrics, [this] { return render_metrics(); }, "publisher");
  if (!server.ok()) return server.status();
  metrics_ = std::move(server.value());
  metrics_url_ = metrics_->url();
  return Status();
}

std::string PublisherImpl::render_metrics() const {
  using metrics::Labels;
  metrics::Exposition out;
  counters_.write(out, "paramcast", {});
  const PublisherStats s = stats();
  out.family("paramcast_published_version", "gauge", "The last version the publisher published.");
  out.sample("paramcast_published_version", {}, static_cast<double>(s.published_version));
  out.family("paramcast_epoch", "gauge", "The data-plane group's epoch (grows with each re-formation).");
  out.sample("paramcast_epoch", {}, static_cast<double>(s.epoch));
  out.family("paramcast_dropped_frames_total", "counter", "Control frames dropped as malformed or unexpected.");
  out.sample("paramcast_dropped_frames_total", {}, static_cast<double>(s.dropped_frames));
  out.family("paramcast_staging_bytes", "gauge", "Peak staging memory of the send pipeline, in bytes.");
  out.sample("paramcast_staging_bytes", {}, static_cast<double>(s.staging_peak_bytes));
  out.family("paramcast_baseline_bytes", "gauge", "Memory held as the delta baseline, in bytes.");
  out.sample("paramcast_baseline_bytes", {}, static_cast<double>(s.baseline_bytes));

  const auto rows = server_.members();
  const auto now = control::Clock::now();
  std::map<std::string, int> states{{"consistent", 0}, {"dirty", 0}, {"empty", 0}, {"lost", 0}, {"missing", 0}};
  std::set<std::string> in_table;
  for (const auto& m : rows) {
    in_table.insert(m.id);
    if (m.lost) ++states["lost"];
    else if (m.state == proto::WeightState::CONSISTENT) ++states["consistent"];
    else if (m.state == proto::WeightState::DIRTY) ++states["dirty"];
    else ++states["empty"];
  }
  for (const auto& id : server_.missing())  // expected and absent; lost members counted above
    if (!in_table.count(id)) ++states["missing"];
  out.family("paramcast_members", "gauge", "Members by state (lost: heartbeats stopped; missing: expected, absent).");
  for (const auto& [state, n] : states) out.sample("paramcast_members", {{"state", state}}, n);

  out.family("paramcast_member_version", "gauge", "The version each member holds (or last held, when dirty).");
  for (const auto& m : rows) out.sample("paramcast_member_version", {{"worker", m.id}}, static_cast<double>(m.weight_version));
  out.family("paramcast_member_consistent", "gauge", "1 when the member holds its version completely, else 0.");
  for (const auto& m : rows)
    out.sample("paramcast_member_consistent", {{"worker", m.id}},
               !m.lost && m.state == proto::WeightState::CONSISTENT ? 1 : 0);
  out.family("paramcast_member_in_group", "gauge", "1 when the member has a rank in the current group.");
  for (const auto& m : rows) out.sample("paramcast_member_in_group", {{"worker", m.id}}, m.rank > 0 ? 1 : 0);
  out.family("paramcast_member_link_bytes_per_second", "gauge",
             "Each member's inbound link rate in its last update, as its parent measured it.");
  for (const auto& m : rows)
    out.sample("paramcast_member_link_bytes_per_second", {{"worker", m.id}}, static_cast<double>(m.last_update_link_rate));
  out.family("paramcast_member_heartbeat_age_seconds", "gauge", "Seconds since the member was last heard from.");
  for (const auto& m : rows)
    out.sample("paramcast_member_heartbeat_age_seconds", {{"worker", m.id}},
               std::chrono::duration<double>(now - m.last_seen).count());
  return out.text();
}

}  // namespace paramcast
