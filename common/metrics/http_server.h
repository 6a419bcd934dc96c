// MetricsServer: serves one process's Prometheus page at /metrics over
// HTTP (cpp-httplib), on a thread of its own. The page is rendered at each
// scrape by the owner's callback (the publisher's or the subscriber's
// figures); anything else gets 404 (405 for other methods, 416 for ranges),
// and nothing a client sends changes state. Two worker threads at most, one
// request per connection, small request limits, short timeouts: a scraper,
// not a web server. Keep it on loopback, or behind a proxy, where the
// network is not trusted.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "common/config.h"
#include "common/status.h"

namespace paramcast::metrics {

class MetricsServer {
 public:
  // Binds options.listen_host:listen_port (0: a free port) and starts
  // serving. An error names the address and why it could not be bound.
  static StatusOr<std::unique_ptr<MetricsServer>> start(const MetricsOptions& options,
                                                         std::function<std::string()> render,
                                                         const std::string& who);
  // Stops serving. Returns within a few seconds whatever clients do: the
  // page is never rendered after this returns, and a worker a client still
  // holds finishes on its own.
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // http://HOST:PORT/metrics, with the bound port.
  std::string url() const { return url_; }

 private:
  struct State;
  explicit MetricsServer(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
  std::string url_;
};

}  // namespace paramcast::metrics
