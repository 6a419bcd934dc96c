// Gloo data plane. One runner thread per communicator executes Gloo's
// blocking broadcast for each queued operation in order, so that callers get
// an asynchronous Work and the control thread is never blocked by data.
//
// An abort that wins. Gloo's TCP pairs fail a pending wait only for some
// failures, and a wait whose send is already on the wire sleeps until Gloo's
// own timeout. So:
//  - abort(), and any failure this rank sees, signals every pair with an
//    exception (as Gloo does on its own timeout): each pair's socket is
//    closed under the pair's lock, and every buffer with a pending receive is
//    woken. Only then do the pending Works complete with the error: once a
//    Work reports the failure, or abort() returns, no Gloo I/O reads into or
//    writes from an operation's memory, so its buffers may be freed.
//  - before it closes, a rank tells every peer why: one word on a sentinel
//    slot (a slot no collective uses). Every rank posts one sentinel receive
//    per peer when the group forms, so the word is written at once on an
//    idle connection and arrives ahead of the close. The word names the rank
//    blamed for an abort (an abort while an operation is queued or running,
//    or a failed operation), or says goodbye (a rank leaving while idle:
//    peers may still be finishing their last broadcast).
//  - a watcher thread polls, every kWatchInterval, for abort notices, and,
//    while an operation runs, for a connection to its parent or children in
//    the broadcast tree that ended without a goodbye (the sentinel receive
//    on that pair fails: a killed peer); either aborts the communicator
//    naming the rank.
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

#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <thread>
#include <tuple>

#include "common/data/gloo/gloo_factory.h"
#include "common/data/gloo/gloo_store_adapter.h"
#include "common/data/gloo/sigpipe_blocked.h"
#include "common/data/work_state.h"
#include "common/log.h"

namespace paramcast::gloo_backend {
namespace {

using data_internal::WorkState;

// How often the watcher looks for failed pairs and kicks an aborted operation.
constexpr auto kWatchInterval = std::chrono::milliseconds(50);
// A slot no Gloo collective uses (collectives use prefixes 0x01-0x08).
constexpr uint8_t kSentinelSlotPrefix = 0x7e;
// The 32-bit word a rank sends on that slot before it closes: 1 + the rank
// it blames for an abort, or kGoodbye when it leaves a healthy group.
using NoticeWord = uint32_t;
constexpr NoticeWord kGoodbye = ~NoticeWord(0);

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(const GroupOptions& options, std::shared_ptr<::gloo::rendezvous::Context> context)
      : options_(options), context_(std::move(context)) {
    SigpipeBlocked blocked;  // inherited by both threads
    arm_sentinels();
    runner_ = std::thread([this] { run(); });
    watcher_ = std::thread([this] { watch(); });
  }

  ~GlooCommunicator() override {
    fail(aborted("communicator destroyed"), Notify::kIfBusy, options_.rank);
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

  void abort(const std::string& reason) override { fail(aborted(reason), Notify::kIfBusy, options_.rank); }

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

  // What a rank tells its peers before it closes. kIfBusy: an abort if an
  // operation is queued or running, else a goodbye (a member that leaves
  // after its last broadcast must not break the peers still finishing
  // theirs). kNever: nothing (the rank reacts to a peer's notice).
  enum class Notify { kNever, kIfBusy, kAlways };

  // Records the first failure, fails every pending operation with it, tells
  // every peer (see `Notify`), then signals every pair (see the top of the
  // file). Idempotent; every caller returns only once the pairs are signalled.
  void fail(const Status& why, Notify mode, int blame) {
    std::deque<Op> dropped;
    std::shared_ptr<WorkState> running;
    Status cause, pending;
    bool notify = mode == Notify::kAlways;
    bool goodbye = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (mode == Notify::kIfBusy && error_.ok()) {
        notify = running_ || !queue_.empty();
        goodbye = !notify;
      }
      if (error_.ok()) error_ = why;
      cause = Status(error_.code(), error_.message());
      pending = aborted("operation aborted: " + error_.message());
      dropped.swap(queue_);
      running = running_;
    }
    {
      std::lock_guard<std::mutex> lock(signal_mu_);
      if (!signalled_) {
        SigpipeBlocked blocked;
        if (notify || goodbye) send_notices(notify ? static_cast<NoticeWord>(blame) + 1 : kGoodbye);
        signal_pairs();
      }
      signalled_ = true;
    }
    // Only now, with no Gloo I/O left on their memory, do the Works complete:
    // a caller woken by them may free the buffers at once.
    if (running) running->complete(cause);  // the running operation fails with the cause
    for (auto& op : dropped) op.state->complete(pending);
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
  void send_notices(NoticeWord word) {
    notice_word_ = word;
    for (int i = 0; i < options_.world_size; ++i) {
      if (i == options_.rank) continue;
      try {
        notice_->send(i, ::gloo::Slot::build(kSentinelSlotPrefix, 0));
      } catch (const std::exception& e) {
        PC_DEBUG("gloo abort notice to rank " << i << ": " << e.what());
      }
    }
  }

  // The first peer that sent an abort notice, and the rank it blamed. The
  // word is written by Gloo's I/O thread, hence the atomic load.
  struct Notice {
    int from = -1;
    int blamed = -1;
  };
  Notice notice() {
    for (int i = 0; i < options_.world_size; ++i) {
      if (i == options_.rank) continue;
      const NoticeWord w = __atomic_load_n(&sentinel_words_[i], __ATOMIC_ACQUIRE);
      if (w != 0 && w != kGoodbye) return Notice{i, static_cast<int>(w - 1)};
    }
    return Notice{};
  }

  Status notice_status(const Notice& n) const {
    const std::string group = "gloo group of epoch " + std::to_string(options_.epoch) + ": ";
    if (n.blamed == n.from) return aborted(group + "rank " + std::to_string(n.from) + " aborted the group");
    return peer_lost(group + "rank " + std::to_string(n.blamed) + " failed (reported by rank " +
                     std::to_string(n.from) + ")");
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
    notice_ = context_->createUnboundBuffer(&notice_word_, sizeof(NoticeWord));
    sentinel_words_.assign(options_.world_size, 0);
    for (int i = 0; i < options_.world_size; ++i) {
      sentinels_.push_back(context_->createUnboundBuffer(&sentinel_words_[i], sizeof(NoticeWord)));
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

  // The first of `peers` whose connection broke, and Gloo's reason; rank -1
  // if none. A peer that said goodbye first is not counted: it left after
  // its last broadcast (its goodbye precedes its end of stream on the same
  // connection, so it is in place when the sentinel fails).
  struct Broken {
    int rank = -1;
    std::string what;
  };
  Broken broken_peer(const std::vector<int>& peers) {
    for (int i : peers) {
      auto& s = sentinels_[i];
      s->abortWaitRecv();  // makes the wait below return at once unless the pair failed
      try {
        s->waitRecv(nullptr, std::chrono::hours(1));
      } catch (const std::exception& e) {
        if (__atomic_load_n(&sentinel_words_[i], __ATOMIC_ACQUIRE) != kGoodbye) return Broken{i, e.what()};
      }
    }
    return Broken{};
  }

  // Polls for abort notices and, while an operation runs, for a broken
  // connection to its parent or children (Gloo never wakes a wait whose send
  // to that peer is already on the wire). See the top of the file.
  void watch() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, kWatchInterval);
      if (stop_) break;
      if (error_.ok()) {
        lock.unlock();
        const Notice n = notice();
        if (n.from >= 0) fail(notice_status(n), Notify::kNever, n.blamed);
        lock.lock();
      }
      if (error_.ok() && running_) {
        const auto peers = tree_peers(running_root_);
        lock.unlock();
        const Broken b = broken_peer(peers);
        if (b.rank >= 0)
          fail(peer_lost("gloo group of epoch " + std::to_string(options_.epoch) + ": connection to rank " +
                         std::to_string(b.rank) + " broke: " + b.what),
               Notify::kAlways, b.rank);
        lock.lock();
      }
      kick_locked();
    }
  }

  // After a failed operation: the cause, preferring a peer's notice (which
  // may trail the end of stream of a peer that gave up first by a few ms).
  std::pair<Status, int> cause_of(const Status& failure, int root) {
    for (int i = 0; i < 10; ++i) {
      const Notice n = notice();
      if (n.from >= 0) return {notice_status(n), -1};
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const Broken b = broken_peer(tree_peers(root));
    return {failure, b.rank >= 0 ? b.rank : options_.rank};
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
      }
      Status status = run_one(op, tag++);
      int blame = -1;  // -1: a peer's notice is the cause, nobody is told again
      if (!status.ok()) {
        bool aborted_here;
        {
          std::lock_guard<std::mutex> lock(mu_);
          aborted_here = !error_.ok();
        }
        if (!aborted_here) std::tie(status, blame) = cause_of(status, op.root);
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        running_.reset();
        if (!status.ok() && error_.ok()) error_ = status;  // before the caller can issue the next one
        if (!error_.ok()) status = Status(error_.code(), error_.message());
      }
      // Pairs signalled first: no Gloo I/O (a send still reading this buffer
      // towards a child) outlives the Work's completion.
      if (!status.ok()) fail(status, blame >= 0 ? Notify::kAlways : Notify::kNever, blame);
      op.state->complete(status);  // no-op when fail() completed it first
    }
    std::lock_guard<std::mutex> lock(mu_);
    runner_done_ = true;
    cv_.notify_all();
  }

  GroupOptions options_;
  std::shared_ptr<::gloo::rendezvous::Context> context_;
  NoticeWord notice_word_ = 0;
  std::unique_ptr<::gloo::transport::UnboundBuffer> notice_;
  std::vector<NoticeWord> sentinel_words_;
  std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> sentinels_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  std::shared_ptr<WorkState> running_;
  int running_root_ = 0;
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
    SigpipeBlocked blocked;  // inherited by Gloo's I/O loop thread, started here
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
