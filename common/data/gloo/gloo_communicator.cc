// Gloo data plane. One worker thread per communicator runs Gloo's blocking
// broadcast for each queued operation in order, so that callers get an
// asynchronous Work and the control thread is never blocked by data.
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <thread>

#include "common/data/gloo/gloo_factory.h"
#include "common/data/work_state.h"
#include "common/log.h"

namespace paramcast::gloo_backend {
namespace {

using data_internal::WorkState;

// What Gloo writes to the store, with the bytes it never initialised zeroed:
// an address blob is one record per peer (a sockaddr_storage of which only
// the family's length is set, then a sequence number); a "rank_N" value is a
// host name in a fixed buffer, of which only the part up to its NUL is set.
std::string defined_bytes(const std::string& key, const std::vector<char>& data) {
  std::string out(data.begin(), data.end());
  const auto slash = key.rfind('/');
  if (key.compare(slash == std::string::npos ? 0 : slash + 1, 5, "rank_") == 0) {
    const auto nul = out.find('\0');
    if (nul != std::string::npos) std::fill(out.begin() + static_cast<std::ptrdiff_t>(nul), out.end(), '\0');
    return out;
  }
  constexpr size_t kRecord = sizeof(sockaddr_storage) + sizeof(ssize_t);
  if (out.empty() || out.size() % kRecord != 0) return out;
  for (size_t at = 0; at < out.size(); at += kRecord) {
    sockaddr_storage ss;
    std::memcpy(&ss, out.data() + at, sizeof ss);
    size_t used = ss.ss_family == AF_INET ? sizeof(sockaddr_in) : ss.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : 0;
    if (ss.ss_family == AF_INET) std::memset(reinterpret_cast<sockaddr_in*>(&ss)->sin_zero, 0, sizeof(sockaddr_in::sin_zero));
    std::memset(reinterpret_cast<char*>(&ss) + used, 0, sizeof ss - used);
    std::memcpy(out.data() + at, &ss, sizeof ss);
  }
  return out;
}

// Presents a ParamCast Store to Gloo, which reports failures by exception.
class StoreAdapter : public ::gloo::rendezvous::Store {
 public:
  StoreAdapter(paramcast::Store& store, std::chrono::milliseconds timeout) : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Status s = store_.set(key, defined_bytes(key, data));
    if (!s.ok()) throw ::gloo::IoException("store set '" + key + "': " + s.to_string());
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_.get(key, timeout_);
    if (!v.ok()) throw ::gloo::IoException("store get '" + key + "': " + v.status().to_string());
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    for (const auto& key : keys) {
      auto v = store_.get(key, timeout);
      if (!v.ok()) throw ::gloo::IoException("store wait '" + key + "': " + v.status().to_string());
    }
  }

 private:
  paramcast::Store& store_;
  std::chrono::milliseconds timeout_;
};

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(const GroupOptions& options, std::shared_ptr<::gloo::rendezvous::Context> context)
      : options_(options), context_(std::move(context)), thread_([this] { run(); }) {}

  ~GlooCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    abort("communicator destroyed");
    thread_.join();
  }

  std::shared_ptr<Work> broadcast(void* data, size_t bytes, int root) override {
    auto work = std::make_shared<Handle>(this);
    if (bytes == 0) {
      work->state->complete(Status());
      return work;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.ok()) {
      work->state->complete(aborted("communicator of epoch " + std::to_string(options_.epoch) +
                                    " is unusable: " + error_.to_string()));
      return work;
    }
    queue_.push_back(Op{static_cast<uint8_t*>(data), bytes, root, work->state});
    cv_.notify_all();
    return work;
  }

  void abort(const std::string& reason) override {
    std::deque<Op> dropped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.ok()) error_ = aborted(reason);
      dropped.swap(queue_);
      if (running_) running_->complete(aborted("operation aborted: " + reason));
    }
    for (auto& op : dropped) op.state->complete(aborted("operation aborted: " + reason));
    // Closing the pairs wakes a Gloo call blocked on a peer that went silent.
    if (!closed_.exchange(true)) {
      try {
        context_->closeConnections();
      } catch (const std::exception& e) {
        PC_DEBUG("gloo closeConnections: " << e.what());
      }
    }
  }

  Status async_error() override {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  Device device() const override { return Device::cpu(); }

 private:
  struct Op {
    uint8_t* data;
    size_t bytes;
    int root;
    std::shared_ptr<WorkState> state;
  };

  // A Work whose wait() aborts the communicator when its deadline passes.
  struct Handle : Work {
    explicit Handle(GlooCommunicator* c) : comm(c), state(std::make_shared<WorkState>()) {}
    Status wait(Deadline deadline) override {
      Status s = state->wait_until(deadline);
      if (s.code() == Code::kTimeout) {
        comm->abort("broadcast deadline passed");
        return timeout_error("broadcast did not finish before its deadline (epoch " +
                             std::to_string(comm->options_.epoch) + ", rank " +
                             std::to_string(comm->options_.rank) + "); communicator aborted");
      }
      return s;
    }
    GlooCommunicator* comm;
    std::shared_ptr<WorkState> state;
  };

  void run() {
    uint32_t tag = 0;
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        op = std::move(queue_.front());
        queue_.pop_front();
        running_ = op.state;
      }
      Status status;
      try {
        ::gloo::BroadcastOptions opts(context_);
        opts.setOutput<uint8_t>(op.data, op.bytes);
        opts.setRoot(op.root);
        opts.setTag(tag++);
        opts.setTimeout(options_.op_timeout);
        ::gloo::broadcast(opts);
      } catch (const ::gloo::IoException& e) {
        const std::string what = e.what();
        status = what.find("imed out") != std::string::npos
                     ? timeout_error("gloo broadcast timed out after " + std::to_string(options_.op_timeout.count()) +
                                     "ms: " + what)
                     : peer_lost("gloo broadcast failed (a peer closed its connection or died): " + what);
      } catch (const std::exception& e) {
        status = internal_error(std::string("gloo broadcast failed: ") + e.what());
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        running_.reset();
        if (!status.ok() && error_.ok()) error_ = status;
        if (!error_.ok() && status.ok()) status = error_;  // aborted while running
      }
      op.state->complete(status);
    }
  }

  GroupOptions options_;
  std::shared_ptr<::gloo::rendezvous::Context> context_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  std::shared_ptr<WorkState> running_;
  Status error_;
  bool stop_ = false;
  std::atomic<bool> closed_{false};
  std::thread thread_;
};

}  // namespace

StatusOr<std::unique_ptr<Communicator>> create(const GroupOptions& options, Store& store) {
  if (options.device.is_cuda())
    return invalid_argument("gloo backend moves host memory; device " + options.device.to_string() +
                            " needs the nccl backend");
  try {
    ::gloo::transport::tcp::attr attr;
    if (!options.gloo_interface.empty()) attr.iface = options.gloo_interface;
    else attr.hostname = options.gloo_hostname;
    auto device = ::gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<::gloo::rendezvous::Context>(options.rank, options.world_size);
    context->setTimeout(options.init_timeout);
    StoreAdapter adapter(store, options.init_timeout);
    ::gloo::rendezvous::PrefixStore prefixed(options.bootstrap, adapter);
    context->connectFullMesh(prefixed, device);
    context->setTimeout(options.op_timeout);
    return std::unique_ptr<Communicator>(new GlooCommunicator(options, std::move(context)));
  } catch (const std::exception& e) {
    return unavailable("gloo group of epoch " + std::to_string(options.epoch) + " (rank " +
                       std::to_string(options.rank) + " of " + std::to_string(options.world_size) +
                       ") could not form: " + e.what());
  }
}

}  // namespace paramcast::gloo_backend
