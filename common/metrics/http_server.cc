#include "common/metrics/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "common/log.h"

namespace paramcast::metrics {

// The server and its thread outlive the MetricsServer when a client holds a
// worker past shutdown (cpp-httplib's stop() waits for its workers): the
// owner is never blocked by a client, and never called after it is gone.
struct MetricsServer::State {
  httplib::Server server;
  std::thread thread;
  std::atomic<bool> done{false};
  std::mutex render_mu;  // held while rendering; the owner clears `render` under it
  std::function<std::string()> render;
};

MetricsServer::MetricsServer(std::shared_ptr<State> state) : state_(std::move(state)) {}

StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::start(const MetricsOptions& options,
                                                               std::function<std::string()> render,
                                                               const std::string& who) {
  auto state = std::make_shared<State>();
  state->render = std::move(render);
  httplib::Server& svr = state->server;
  svr.new_task_queue = [] { return new httplib::ThreadPool(2); };
  // SO_REUSEADDR only: cpp-httplib's default (SO_REUSEPORT) would let a
  // second process bind the same port and take half the scrapes, silently.
  svr.set_socket_options([](int sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  svr.set_payload_max_length(4096);
  svr.set_read_timeout(std::chrono::seconds(2));
  svr.set_write_timeout(std::chrono::seconds(2));
  svr.set_keep_alive_max_count(1);  // one request per connection: no idle worker held by a scraper
  // GET /metrics and nothing else; no ranges (cpp-httplib 0.11 would build
  // one copy of the page per range asked for).
  svr.set_pre_routing_handler([](const httplib::Request& req, httplib::Response& res) {
    if (req.has_header("Range")) {
      res.status = 416;
      return httplib::Server::HandlerResponse::Handled;
    }
    if (req.method != "GET" && req.method != "HEAD") {
      res.status = 405;
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  State* raw = state.get();
  svr.Get("/metrics", [raw](const httplib::Request&, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(raw->render_mu);
    if (!raw->render) {
      res.status = 503;
      return;
    }
    res.set_content(raw->render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  int port = options.listen_port;
  const std::string& host = options.listen_host;
  bool bound = port == 0 ? (port = svr.bind_to_any_port(host)) > 0 : svr.bind_to_port(host, port);
  if (!bound)
    return unavailable("metrics.listen " + host + ":" + std::to_string(options.listen_port) +
                       ": cannot serve there (the address is in use, or not one of this host's)");
  state->thread = std::thread([state] {  // the thread holds the state: it may outlive the owner
    state->server.listen_after_bind();
    state->done = true;
  });
  auto server = std::unique_ptr<MetricsServer>(new MetricsServer(std::move(state)));
  const bool v6 = host.find(':') != std::string::npos;
  server->url_ = "http://" + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port) + "/metrics";
  PC_INFO(who << ": metrics at " << server->url_);
  return server;
}

MetricsServer::~MetricsServer() {
  {
    // A scrape rendering now finishes first; none starts after this.
    std::lock_guard<std::mutex> lock(state_->render_mu);
    state_->render = nullptr;
  }
  // stop() does nothing before the listening loop has begun, and the loop
  // ends only once its workers are done: ask until it is out, for a while.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  while (!state_->done && std::chrono::steady_clock::now() < deadline) {
    state_->server.stop();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (state_->done) {
    state_->thread.join();
  } else {
    state_->server.stop();
    state_->thread.detach();  // a client still holds a worker; it ends with the client's timeouts
  }
}

}  // namespace paramcast::metrics
