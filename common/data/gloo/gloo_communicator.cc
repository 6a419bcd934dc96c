// Gloo data plane. One runner thread per communicator executes Gloo's
// blocking broadcast for each queued operation in order, so that callers get
// an asynchronous Work and the control thread is never blocked by data.
//
// An abort that wins. Gloo's TCP pairs fail a pending wait only for some
// failures, and a wait whose send is already on the wire sleeps until Gloo's
// own timeout. So:
//  - abort() (and any failure seen by this rank) signals every pair with an
//    exception (as Gloo does on a timeout): each pair's socket is closed under
//    the pair's lock and every buffer with a pending receive or queued send
//    is woken. After abort()
//    returns, no Gloo I/O reads into or writes from an operation's memory.
//    Closing our sockets also fails the peers' pairs, so one rank's failure
//    cascades to every rank of the group.
//  - a watcher thread polls, every kWatchInterval, one sentinel receive per
//    peer that is never matched: a pair that failed (RST, EOF, a peer's abort)
//    fails its sentinel. When that peer is the running broadcast's parent or
//    child and the broadcast is still running an interval later, the watcher
//    aborts the communicator naming that rank. This catches a peer's failure
//    while our own wait is parked on an in-flight send that Gloo never wakes.
//  - after an abort, the watcher (and the destructor) kick the running
//    operation's buffer (abortWaitRecv/abortWaitSend) until Gloo's call
//    returns: its Work already completed with the error when abort() ran.
// The destructor therefore ends within a few watch intervals; it is still run
// on a reaper thread (common/data/reaper.h), never by a control thread.
//
// Threads: runner_ owns the Gloo calls; watcher_ polls sentinels; mu_ guards
// the queue, the running operation and the error. Locks: mu_ may be held while
// calling a Gloo buffer's abortWait*; Gloo never calls back into this class.
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include <atomic>
#include <deque>
#include <thread>

#include "common/data/gloo/gloo_factory.h"
#include "common/data/gloo/gloo_store_adapter.h"
#include "common/data/work_state.h"
#include "common/log.h"

namespace paramcast::gloo_backend {
namespace {

using data_internal::WorkState;

// How often the watcher looks for failed pairs and kicks an aborted operation.
constexpr auto kWatchInterval = std::chrono::milliseconds(50);
// A slot no Gloo collective uses (collectives use prefixes 0x01-0x08).
constexpr uint8_t kSentinelSlotPrefix = 0x7e;
// The byte an aborting rank sends on that slot.
constexpr char kAbortNotice = 1;

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(const GroupOptions& options, std::shared_ptr<::gloo::rendezvous::Context> context)
      : options_(options), context_(std::move(context)) {
    arm_sentinels();
    runner_ = std::thread([this] { run(); });
    watcher_ = std::thread([this] { watch(); });
  }

  ~GlooCommunicator() override {
    // A healthy group is left quietly (peers may still be finishing the last
    // broadcast); a failed one has told its peers already.
    {
      std::lock_guard<std::mutex> lock(signal_mu_);
      if (!signalled_) signal_pairs();
      signalled_ = true;
    }
    fail(aborted("communicator destroyed"), Notify::kNever);
    std::unique_lock<std::mutex> lock(mu_);
    stop_ = true;
    cv_.notify_all();
    while (!runner_done_) {
      kick_locked();
      cv_.wait_for(lock, std::chrono::milliseconds(10));
    }
    lock.unlock();
    runner_.join();
    watcher_.join();
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

  void abort(const std::string& reason) override { fail(aborted(reason), Notify::kIfBusy); }

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

  // Whether an abort tells the peers. An abort() while no operation is queued
  // or running stays local (kIfBusy): a member that leaves after its last
  // broadcast must not break the peers still finishing theirs.
  enum class Notify { kNever, kIfBusy, kAlways };

  // Records the first failure, fails every pending operation with it, tells
  // every peer (see `Notify`), then signals every pair (see the top of the
  // file). Idempotent; every caller returns only once the pairs are signalled.
  void fail(const Status& why, Notify mode) {
    std::deque<Op> dropped;
    Status pending;
    bool notify = mode == Notify::kAlways;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (mode == Notify::kIfBusy && error_.ok()) notify = running_ || !queue_.empty();
      if (error_.ok()) error_ = why;
      pending = aborted("operation aborted: " + error_.message());
      dropped.swap(queue_);
      // The running operation fails with the cause; queued ones were aborted.
      if (running_) running_->complete(Status(error_.code(), error_.message()));
    }
    for (auto& op : dropped) op.state->complete(pending);
    {
      std::lock_guard<std::mutex> lock(signal_mu_);
      if (!signalled_) {
        if (notify) send_abort_notices();
        signal_pairs();
      }
      signalled_ = true;
    }
    std::lock_guard<std::mutex> lock(mu_);
    kick_locked();
    cv_.notify_all();
  }

  // Gloo's TCP transport signals every pair of a context when a wait times
  // out; a 1 ms wait on a buffer that nothing feeds is the public way to ask
  // for that (its pair header is not installed by every distribution).
  void signal_pairs() {
    char byte = 0;
    auto probe = context_->createUnboundBuffer(&byte, 1);
    try {
      probe->waitRecv(nullptr, std::chrono::milliseconds(1));
    } catch (const std::exception& e) {
      PC_DEBUG("gloo epoch " << options_.epoch << ": pairs signalled (" << e.what() << ")");
    }
  }

  // One byte on each peer's sentinel slot says "this rank aborted the group".
  // The peer's sentinel receive was posted when the group formed, so on an
  // idle connection Gloo writes the byte at once, and closing the socket
  // right after still delivers it (an orderly close). A peer not on the
  // running broadcast's path learns of the abort this way.
  void send_abort_notices() {
    for (int i = 0; i < options_.world_size; ++i) {
      if (i == options_.rank) continue;
      try {
        notice_->send(i, ::gloo::Slot::build(kSentinelSlotPrefix, 0));
      } catch (const std::exception& e) {
        PC_DEBUG("gloo abort notice to rank " << i << ": " << e.what());
      }
    }
  }

  // The first peer that sent an abort notice; -1 if none. The byte is
  // written by Gloo's I/O thread into sentinel_bytes_, hence the atomic load.
  int notifying_peer() {
    for (int i = 0; i < options_.world_size; ++i)
      if (i != options_.rank && __atomic_load_n(&sentinel_bytes_[i], __ATOMIC_ACQUIRE) == kAbortNotice) return i;
    return -1;
  }

  // Wakes a Gloo wait of the running operation; only after a failure.
  void kick_locked() {
    if (error_.ok() || !running_buffer_) return;
    running_buffer_->abortWaitRecv();
    running_buffer_->abortWaitSend();
  }

  // One receive per peer on a slot that no one sends to: it fails exactly
  // when that peer's pair fails.
  void arm_sentinels() {
    notice_ = context_->createUnboundBuffer(&notice_byte_, 1);
    sentinel_bytes_.resize(options_.world_size);
    for (int i = 0; i < options_.world_size; ++i) {
      sentinels_.push_back(context_->createUnboundBuffer(&sentinel_bytes_[i], 1));
      if (i != options_.rank) sentinels_.back()->recv(i, ::gloo::Slot::build(kSentinelSlotPrefix, 0));
    }
  }

  // The ranks this rank exchanges bytes with in a broadcast from `root`: its
  // parent and children in Gloo's binomial tree (gloo/broadcast.cc).
  std::vector<int> tree_peers(int root) const {
    std::vector<int> peers;
    const size_t n = static_cast<size_t>(options_.world_size);
    const size_t vrank = (static_cast<size_t>(options_.rank) + n - static_cast<size_t>(root)) % n;
    size_t dim = 0;
    while ((size_t(1) << dim) < n) ++dim;
    size_t mask = (size_t(1) << dim) - 1;
    for (size_t i = 0; i < dim; ++i) {
      mask ^= size_t(1) << i;
      if ((vrank & mask) != 0) continue;
      const size_t vpeer = vrank ^ (size_t(1) << i);
      if (vpeer < n) peers.push_back(static_cast<int>((vpeer + static_cast<size_t>(root)) % n));
    }
    return peers;
  }

  // The first of `peers` whose pair failed, with Gloo's reason; "" if none.
  std::string failed_peer(const std::vector<int>& peers) {
    for (int i : peers) {
      auto& s = sentinels_[i];
      s->abortWaitRecv();  // makes the wait below return at once unless the pair failed
      try {
        s->waitRecv(nullptr, std::chrono::hours(1));
      } catch (const std::exception& e) {
        return "rank " + std::to_string(i) + ": " + e.what();
      }
    }
    return "";
  }

  // A peer of the running operation whose connection failed fails the
  // operation, once the same operation is still running one interval later
  // (a peer that sent its last bytes and left is not a failure: those bytes
  // are read before its end of stream).
  void watch() {
    std::unique_lock<std::mutex> lock(mu_);
    uint64_t suspect = 0;  // sequence number of the operation seen with a failed peer
    while (!stop_) {
      cv_.wait_for(lock, kWatchInterval);
      if (stop_) break;
      if (error_.ok()) {
        const int notifier = notifying_peer();
        if (notifier >= 0) {
          lock.unlock();
          fail(aborted("gloo group of epoch " + std::to_string(options_.epoch) + ": rank " + std::to_string(notifier) +
                       " aborted the group"),
               Notify::kNever);
          lock.lock();
        }
      }
      if (error_.ok() && running_) {
        const uint64_t seq = running_seq_;
        const auto peers = tree_peers(running_root_);
        lock.unlock();
        std::string peer = failed_peer(peers);
        lock.lock();
        if (peer.empty() || seq != running_seq_ || !running_) {
          suspect = 0;
        } else if (suspect != seq) {
          suspect = seq;
        } else {
          lock.unlock();
          fail(peer_lost("gloo group of epoch " + std::to_string(options_.epoch) + ": connection to " + peer),
               Notify::kAlways);
          lock.lock();
        }
      }
      kick_locked();
    }
  }

  // Publishes the running operation's buffer to kick_locked() for as long as
  // it lives. Declared after the BroadcastOptions that own the buffer, so
  // that it is withdrawn before the buffer is freed, also while unwinding.
  class RunningBuffer {
   public:
    RunningBuffer(GlooCommunicator* c, ::gloo::transport::UnboundBuffer* b) : c_(c) {
      std::lock_guard<std::mutex> lock(c_->mu_);
      armed_ = c_->error_.ok();
      if (armed_) c_->running_buffer_ = b;
    }
    ~RunningBuffer() {
      std::lock_guard<std::mutex> lock(c_->mu_);
      c_->running_buffer_ = nullptr;
    }
    bool armed() const { return armed_; }

   private:
    GlooCommunicator* c_;
    bool armed_ = false;
  };

  Status run_one(const Op& op, uint32_t tag) {
    try {
      ::gloo::BroadcastOptions opts(context_);
      auto buffer = context_->createUnboundBuffer(op.data, op.bytes);
      RunningBuffer running(this, buffer.get());
      if (!running.armed()) return Status();  // aborted between dequeue and start; already completed
      opts.setOutput<uint8_t>(std::move(buffer));
      opts.setRoot(op.root);
      opts.setTag(tag);
      opts.setTimeout(options_.op_timeout);
      ::gloo::broadcast(opts);
      return Status();
    } catch (const ::gloo::IoException& e) {
      const std::string what = e.what();
      return what.find("imed out") != std::string::npos
                 ? timeout_error("gloo broadcast timed out after " + std::to_string(options_.op_timeout.count()) +
                                 "ms: " + what)
                 : peer_lost("gloo broadcast failed (a peer closed its connection or died): " + what);
    } catch (const std::exception& e) {
      return internal_error(std::string("gloo broadcast failed: ") + e.what());
    }
  }

  void run() {
    uint32_t tag = 0;
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) break;
        op = std::move(queue_.front());
        queue_.pop_front();
        running_ = op.state;
        running_root_ = op.root;
        ++running_seq_;
      }
      Status status = run_one(op, tag++);
      {
        std::lock_guard<std::mutex> lock(mu_);
        running_.reset();
        if (!status.ok() && error_.ok()) error_ = status;  // before the caller can issue the next one
        if (!error_.ok()) status = Status(error_.code(), error_.message());
      }
      op.state->complete(status);  // no-op when fail() completed it first
      if (!status.ok()) fail(status, Notify::kAlways);
    }
    std::lock_guard<std::mutex> lock(mu_);
    runner_done_ = true;
    cv_.notify_all();
  }

  GroupOptions options_;
  std::shared_ptr<::gloo::rendezvous::Context> context_;
  char notice_byte_ = kAbortNotice;
  std::unique_ptr<::gloo::transport::UnboundBuffer> notice_;
  std::vector<char> sentinel_bytes_;
  std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> sentinels_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  std::shared_ptr<WorkState> running_;
  int running_root_ = 0;
  uint64_t running_seq_ = 0;
  ::gloo::transport::UnboundBuffer* running_buffer_ = nullptr;  // owned by the runner's BroadcastOptions
  Status error_;
  bool stop_ = false;
  bool runner_done_ = false;
  std::mutex signal_mu_;  // held while the pairs are signalled, so that every abort() returns after it
  bool signalled_ = false;
  std::thread runner_;
  std::thread watcher_;
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
