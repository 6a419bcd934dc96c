// An engine's Prometheus page (metrics.listen): its weight state and the
// updates it received, labelled with its worker id.
#include "inference_side/subscriber_impl.h"

namespace paramcast {

Status SubscriberImpl::start_metrics() {
  if (!cfg_.metrics.enabled()) return Status();
  auto server = metrics::MetricsServer::start(cfg_.metrics, [this] { return render_metrics(); }, id_);
  if (!server.ok()) return server.status();
  metrics_ = std::move(server.value());
  metrics_url_ = metrics_->url();
  return Status();
}

std::string SubscriberImpl::render_metrics() const {
  const metrics::Labels worker{{"worker", id_}};
  metrics::Exposition out;
  counters_.write(out, "paramcast_subscriber", worker);
  const WeightState s = state();
  out.family("paramcast_subscriber_version", "gauge", "The last version this engine applied completely.");
  out.sample("paramcast_subscriber_version", worker, static_cast<double>(s.version));
  out.family("paramcast_subscriber_consistent", "gauge", "1 when this engine holds its version completely, else 0.");
  out.sample("paramcast_subscriber_consistent", worker, s.kind == WeightStateKind::kConsistent ? 1 : 0);
  out.family("paramcast_subscriber_joined", "gauge", "1 while a publisher has this engine as a member.");
  out.sample("paramcast_subscriber_joined", worker, joined() ? 1 : 0);
  out.family("paramcast_subscriber_staging_bytes", "gauge", "Peak staging memory of the receive pipeline, in bytes.");
  out.sample("paramcast_subscriber_staging_bytes", worker, static_cast<double>(staging_peak()));
  return out.text();
}

}  // namespace paramcast
