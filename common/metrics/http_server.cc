#include "common/metrics/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "common/log.h"

namespace paramcast::metrics {

struct MetricsServer::State {
  httplib::Server server;
  std::thread thread;
  std::atomic<bool> done{false};
};

MetricsServer::MetricsServer(std::unique_ptr<State> state) : state_(std::move(state)) {}

StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::start(const MetricsOptions& options,
                                                               std::function<std::string()> render,
                                                               const std::string& who) {
  auto state = std::make_unique<State>();
  httplib::Server& svr = state->server;
  svr.new_task_queue = [] { return new httplib::ThreadPool(2); };
  // SO_REUSEADDR only: cpp-httplib's default (SO_REUSEPORT) would let a
  // second process bind the same port and take half the scrapes, silently.
  svr.set_socket_options([](int sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  svr.set_payload_max_length(4096);
  svr.set_read_timeout(std::chrono::seconds(5));
  svr.set_write_timeout(std::chrono::seconds(5));
  svr.set_keep_alive_max_count(16);
  svr.Get("/metrics", [render](const httplib::Request&, httplib::Response& res) {
    res.set_content(render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  int port = options.listen_port;
  const std::string& host = options.listen_host;
  bool bound = port == 0 ? (port = svr.bind_to_any_port(host)) > 0 : svr.bind_to_port(host, port);
  if (!bound)
    return unavailable("metrics.listen " + host + ":" + std::to_string(options.listen_port) +
                       ": cannot serve there (the address is in use, or not one of this host's)");
  State* raw = state.get();
  state->thread = std::thread([raw] {
    raw->server.listen_after_bind();
    raw->done = true;
  });
  auto server = std::unique_ptr<MetricsServer>(new MetricsServer(std::move(state)));
  const bool v6 = host.find(':') != std::string::npos;
  server->url_ = "http://" + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port) + "/metrics";
  PC_INFO(who << ": metrics at " << server->url_);
  return server;
}

MetricsServer::~MetricsServer() {
  // stop() does nothing before the listening loop has begun: ask until the
  // thread is out of it.
  while (!state_->done) {
    state_->server.stop();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  state_->thread.join();
}

}  // namespace paramcast::metrics
