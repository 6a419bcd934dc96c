// Gloo data plane. Each broadcast runs down a binomial tree (tree.h) in
// chunks of kChunkBytes, pipelined: a rank forwards chunk i to its children
// as soon as it landed, at most kWindow chunks ahead of what each child has
// taken. A non-root rank posts the receives of a broadcast when it is issued
// (broadcast()), so a parent can stream into it while it still forwards the
// previous one. One runner thread per communicator drives the operations in
// order (receives, then posts the sends); a drainer thread takes the send
// completions, per child, as Gloo reports them (flight.h), so that callers get
// an asynchronous Work and the control thread is never blocked by data.
//
// Slow is not dead. A broadcast fails for slowness only when a link this rank
// sends on takes nothing for stall_timeout: the watcher sees it and fails the
// group with kTimeout naming that link. Receives wait as long as the sender
// keeps its links moving (the sender is the one that sees a stalled link; a
// parent may be waiting, legitimately, for a slow sibling), bounded only by
// op_timeout and the caller's deadline. Per-link bytes and busy time give
// each link's rate (link_stats()).
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
//    or a failed operation) and whether it was a stall, or says goodbye (a
//    rank leaving while idle: peers may still be finishing their last
//    broadcast).
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
// Threads: runner_ waits for receives and posts sends; drainer_ waits for send
// completions; watcher_ polls sentinels and the stall clock; callers of
// broadcast() post receives. mu_ guards the queue, the running operation, its
// flight, the link figures and the error. Locks: mu_ may be held while posting
// to Gloo or calling a buffer's abortWait*; Gloo never calls back into this class.
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
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

#include "common/data/gloo/flight.h"
#include "common/data/gloo/gloo_factory.h"
#include "common/data/gloo/mesh.h"
#include "common/data/gloo/shed.h"
#include "common/data/gloo/sigpipe_blocked.h"
#include "common/data/gloo/tree.h"
#include "common/data/work_state.h"
#include "common/log.h"
#include "common/units.h"

namespace paramcast::gloo_backend {
namespace {

using data_internal::DeadlineWork;
using data_internal::WorkState;

// How often the watcher looks for failed pairs and kicks an aborted operation.
constexpr auto kWatchInterval = std::chrono::milliseconds(50);
// Slots no Gloo collective uses (collectives use prefixes 0x01-0x08).
constexpr uint8_t kSentinelSlotPrefix = 0x7e;
constexpr uint8_t kChunkSlotPrefix = 0x7d;  // + the operation's sequence number
// A broadcast moves in chunks of this size, at most kWindow chunks ahead of
// what each child has taken: progress is seen per chunk, and a link with a
// slow reader holds back at most kWindow chunks of its siblings' stream.
constexpr size_t kChunkBytes = size_t(1) << 20;
constexpr size_t kWindow = 4;
// Gloo-level waits never time out on their own (a Gloo timeout closes every
// pair before this rank can tell its peers why); the watcher bounds them.
constexpr auto kForever = std::chrono::hours(24 * 365);
// Per level of the tree below a rank beyond its children, the extra time it
// gives a stalled child before blaming it (stall_grace()).
constexpr auto kStallGrace = std::chrono::seconds(1);
// The 32-bit word a rank sends on that slot before it closes: the kind in the
// top byte, 1 + the rank it blames below; or kGoodbye when it leaves a
// healthy group.
using NoticeWord = uint32_t;
constexpr NoticeWord kGoodbye = ~NoticeWord(0);
// kShed: to one child only, which the sender shed (shed.h).
enum NoticeKind : NoticeWord { kFailed = 0, kStalled = 1, kShed = 2 };
NoticeWord notice_word(NoticeKind kind, int blamed) {
  return (static_cast<NoticeWord>(kind) << 24) | (static_cast<NoticeWord>(blamed + 1) & 0xffffff);
}

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(const GroupOptions& options, std::shared_ptr<::gloo::rendezvous::Context> context)
      : options_(options),
        context_(std::move(context)),
        links_(static_cast<size_t>(options.world_size)),
        shed_(options.world_size, options.shed_floor, options.shed_window),
        shed_words_(static_cast<size_t>(options.world_size), 0) {
    SigpipeBlocked blocked;  // inherited by both threads (and the drainers the runner starts)
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
    auto work = std::make_shared<DeadlineWork>(this, options_.epoch, options_.rank);
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
    queue_.push_back(Op{static_cast<uint8_t*>(data), bytes, root, next_seq_++, work->state});
    cv_.notify_all();
    return work;
  }

  void abort(const std::string& reason) override { fail(aborted(reason), Notify::kIfBusy, options_.rank); }

  Status async_error() override {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

  std::vector<LinkStats> link_stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<LinkStats> out;
    for (size_t i = 0; i < links_.size(); ++i)
      if (links_[i].bytes_sent || links_[i].bytes_received || links_[i].shed) {
        out.push_back(links_[i]);
        out.back().peer = static_cast<int>(i);
      }
    return out;
  }

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  Device device() const override { return Device::cpu(); }

 private:
  struct Op {
    uint8_t* data;
    size_t bytes;
    int root;
    uint32_t seq;  // the same on every rank: the chunk slot
    std::shared_ptr<WorkState> state;
  };

  // The operation the runner is driving; guarded by mu_ (its buffers are
  // owned by run_one and outlive their registration here).
  struct Running {
    BinomialTree tree;  // its children: those not shed when it started
    int root = 0;
    size_t chunks = 0;
    size_t bytes = 0;
    uint64_t slot = 0;
    size_t recvs_posted = 0;
    ::gloo::transport::UnboundBuffer* in = nullptr;        // receives from the parent
    std::vector<::gloo::transport::UnboundBuffer*> out;     // sends, one buffer per child
    Flight flight;
    Clock::time_point start;
    Clock::duration stall_grace{0};
    Status failure;  // a drainer's: the pair to its child failed
    size_t chunk_bytes(size_t i) const { return std::min(kChunkBytes, bytes - i * kChunkBytes); }
  };

  // A Work whose wait() aborts the communicator when its deadline passes.
  // What a rank tells its peers before it closes. kIfBusy: an abort if an
  // operation is queued or running, else a goodbye (a member that leaves
  // after its last broadcast must not break the peers still finishing
  // theirs). kNever: nothing (the rank reacts to a peer's notice).
  enum class Notify { kNever, kIfBusy, kAlways };

  std::string who(int rank) const {
    std::string s = "rank " + std::to_string(rank);
    if (rank >= 0 && static_cast<size_t>(rank) < options_.members.size() && !options_.members[rank].empty())
      s += " (" + options_.members[rank] + ")";
    return s;
  }
  std::string group() const { return "gloo group of epoch " + std::to_string(options_.epoch) + ": "; }

  // Records the first failure, fails every pending operation with it, tells
  // every peer (see `Notify`), then signals every pair (see the top of the
  // file). Idempotent; every caller returns only once the pairs are signalled.
  void fail(const Status& why, Notify mode, int blame, NoticeKind kind = kFailed) {
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
        if (notify || goodbye) send_notices(notify ? notice_word(kind, blame) : kGoodbye);
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

  // One word on each peer's sentinel slot says why this rank closes. The
  // peer's sentinel receive was posted when the group formed, so on an idle
  // connection Gloo writes it at once, and closing the socket right after
  // still delivers it (an orderly close). A peer not on the running
  // broadcast's path learns of the abort this way.
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

  // The first peer that sent an abort notice, the rank it blamed and why.
  // The word is written by Gloo's I/O thread, hence the atomic load.
  struct Notice {
    int from = -1;
    int blamed = -1;
    NoticeWord kind = kFailed;
  };
  Notice notice() {
    for (int i = 0; i < options_.world_size; ++i) {
      if (i == options_.rank) continue;
      const NoticeWord w = __atomic_load_n(&sentinel_words_[i], __ATOMIC_ACQUIRE);
      if (w == 0 || w == kGoodbye) continue;
      const int blamed = static_cast<int>(w & 0xffffff) - 1;
      if (blamed < 0 || blamed >= options_.world_size) return Notice{i, i, kFailed};  // garbled: blame the sender
      return Notice{i, blamed, w >> 24};
    }
    return Notice{};
  }

  Status notice_status(const Notice& n) const {
    if (n.kind == kShed && n.blamed == options_.rank)
      return timeout_error(group() + "this rank was shed by " + who(n.from) +
                           ": its inbound link ran below the floor of " + format_bytes(options_.shed_floor) +
                           "/s (publisher.on_slow_member: shed); it is out of this update, the others go on");
    if (n.kind == kStalled)
      return timeout_error(group() + who(n.from) + " saw no progress for " +
                           format_duration(options_.stall_timeout) + " (stall_timeout) sending to " + who(n.blamed));
    if (n.blamed == n.from) return aborted(group() + who(n.from) + " aborted the group");
    return peer_lost(group() + who(n.blamed) + " failed (reported by " + who(n.from) + ")");
  }

  // Wakes the Gloo waits of the running operation; only after a failure.
  void kick_locked() {
    if (error_.ok() || !running_op_) return;
    if (running_op_->in) running_op_->in->abortWaitRecv();
    for (auto* b : running_op_->out) b->abortWaitSend();
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

  // The first of `peers` whose connection broke, and Gloo's reason; rank -1
  // if none. A peer that wrote a word first (a goodbye, or a notice the
  // caller reads) is not counted: the word completed the sentinel receive,
  // which then never fails. Either precedes its end of stream on the same
  // connection.
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
        if (__atomic_load_n(&sentinel_words_[i], __ATOMIC_ACQUIRE) == 0) return Broken{i, e.what()};
      }
    }
    return Broken{};
  }

  // The link of the running operation that made no progress for its stall
  // window, as an error; OK if none. Called with mu_ held.
  std::pair<Status, int> stalled_locked(Clock::time_point now) {
    const Running& r = *running_op_;
    const Flight::Child* slow = r.flight.slowest();
    if (slow && now - slow->last_progress > options_.stall_timeout + r.stall_grace) {
      const auto& link = links_[static_cast<size_t>(slow->rank)];
      const std::string rate =
          link.send_rate() > 0 ? format_bytes(static_cast<uint64_t>(link.send_rate())) + "/s" : "nothing yet";
      return {timeout_error(group() + "no progress for " + format_duration(now - slow->last_progress) +
                            " sending to " + who(slow->rank) + " (stall_timeout " +
                            format_duration(options_.stall_timeout) + "): it took " + format_bytes(slow->taken_bytes) +
                            " of this " + format_bytes(r.bytes) + " broadcast; that link's rate so far " + rate),
              slow->rank};
    }
    if (now - r.start > options_.op_timeout)
      return {timeout_error(group() + "broadcast of " + format_bytes(r.bytes) + " still running after " +
                            format_duration(now - r.start) + " (the backstop, op_timeout " +
                            format_duration(options_.op_timeout) + ")"),
              options_.rank};
    return {Status(), -1};
  }

  // Polls for abort notices, for a stalled link of the running operation
  // and, while an operation runs, for a broken connection to its parent or
  // children (Gloo never wakes a wait whose send to that peer is already on
  // the wire). See the top of the file.
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
      if (error_.ok() && running_op_) {
        auto [stall, blamed] = stalled_locked(Clock::now());
        if (!stall.ok()) {
          lock.unlock();
          PC_WARN(stall.message());
          fail(stall, Notify::kAlways, blamed, blamed == options_.rank ? kFailed : kStalled);
          lock.lock();
        }
      }
      if (error_.ok() && running_op_ && shed_.enabled()) {
        const auto shedding = shed_locked(Clock::now());
        if (!shedding.empty()) {
          lock.unlock();
          for (int c : shedding) send_shed_notice(c);
          lock.lock();
        }
      }
      if (error_.ok() && running_op_) {
        const auto peers = unshed(running_op_->tree.peers());
        lock.unlock();
        const Broken b = broken_peer(peers);
        const Notice n = notice();  // a notice precedes its sender's close: it explains the break
        if (n.from >= 0)
          fail(notice_status(n), Notify::kNever, n.blamed);
        else if (b.rank >= 0)
          fail(peer_lost(group() + "connection to " + who(b.rank) + " broke: " + b.what), Notify::kAlways, b.rank);
        lock.lock();
      }
      kick_locked();
    }
  }

  // Shedding (publisher.on_slow_member: shed; shed.h): the children of the
  // running broadcast that are leaves of its tree, have work waiting, and
  // whose link ran below the floor over the last window of busy time. Each is
  // shed: nothing more is posted to it (what it is owed still drains, so its
  // memory is released only once Gloo is done with it), the window and later
  // broadcasts go on without it, and LinkStats says so. Called with mu_ held.
  std::vector<int> shed_locked(Clock::time_point now) {
    Running& r = *running_op_;
    std::vector<int> out;
    for (int c : r.tree.children) {
      const Flight::Child* fc = r.flight.child(c);
      if (!fc || fc->shed || fc->pending.empty()) continue;
      if (!BinomialTree::of(c, options_.world_size, r.root).children.empty()) continue;  // leaves only
      const auto& link = links_[static_cast<size_t>(c)];
      const auto busy = link.send_busy + (now - fc->last_progress);
      const auto v = shed_.observe(c, link.bytes_sent, std::chrono::duration_cast<Clock::duration>(busy));
      if (!v.shed) continue;
      r.flight.mark_shed(c);
      links_[static_cast<size_t>(c)].shed = true;
      PC_WARN(group() << "shedding " << who(c) << ": its link ran at "
                      << format_bytes(static_cast<uint64_t>(v.rate)) << "/s over " << format_duration(v.over)
                      << " of busy time, below the floor of " << format_bytes(options_.shed_floor)
                      << "/s (publisher.on_slow_member: shed); the others go on without it");
      out.push_back(c);
    }
    if (!out.empty()) cv_.notify_all();  // the window may be open now
    return out;
  }

  // The shed child learns it on its sentinel slot, after the chunks it was
  // owed (Gloo writes a pair's sends in order). Watcher thread only.
  void send_shed_notice(int child) {
    shed_words_[static_cast<size_t>(child)] = notice_word(kShed, child);
    try {
      auto buffer = context_->createUnboundBuffer(&shed_words_[static_cast<size_t>(child)], sizeof(NoticeWord));
      buffer->send(child, ::gloo::Slot::build(kSentinelSlotPrefix, 0));
      shed_notices_.push_back(std::move(buffer));  // Gloo may still be writing it
    } catch (const std::exception& e) {
      PC_DEBUG("gloo shed notice to rank " << child << ": " << e.what());
    }
  }

  // `peers` without the children this rank shed (their connections end on
  // purpose). Called with mu_ held.
  std::vector<int> unshed(std::vector<int> peers) const {
    std::erase_if(peers, [&](int p) { return shed_.shed(p); });
    return peers;
  }

  // After a failed operation: the cause, preferring a peer's notice (which
  // may trail the end of stream of a peer that gave up first by a few ms).
  std::pair<Status, int> cause_of(const Status& failure, const BinomialTree& tree) {
    for (int i = 0; i < 10; ++i) {
      const Notice n = notice();
      if (n.from >= 0) return {notice_status(n), -1};
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::vector<int> peers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      peers = unshed(tree.peers());
    }
    const Broken b = broken_peer(peers);
    return {failure, b.rank >= 0 ? b.rank : options_.rank};
  }

  // Posts the parent's receives this rank may hold: a leaf takes the whole
  // broadcast at once; a rank with children stays kWindow chunks ahead of
  // what every child took, so that its parent's link to it moves at the pace
  // of its own slowest link instead of racing a whole broadcast ahead (a
  // parent that waits on this rank sees progress while the subtree makes it).
  void post_receives_locked(Running& r) {
    const size_t limit = r.out.empty() || !r.flight.any_active() ? r.chunks
                                                                 : std::min(r.chunks, r.flight.min_taken_chunks() + kWindow);
    for (; r.recvs_posted < limit; ++r.recvs_posted)
      r.in->recv(r.tree.parent, r.slot, r.recvs_posted * kChunkBytes, r.chunk_bytes(r.recvs_posted));
  }

  // Receives each chunk from the parent and posts it to every child.
  Status feed(Running& r) {
    for (size_t i = 0; i < r.chunks; ++i) {
      const size_t len = r.chunk_bytes(i);
      if (r.in) {
        if (!r.in->waitRecv(nullptr, kForever)) {
          std::lock_guard<std::mutex> lock(mu_);
          return r.failure.ok() ? aborted("broadcast interrupted") : r.failure;
        }
        std::lock_guard<std::mutex> lock(mu_);
        links_[static_cast<size_t>(r.tree.parent)].bytes_received += len;
      }
      if (r.out.empty()) continue;
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !error_.ok() || !r.failure.ok() || r.flight.window_open(kWindow); });
      if (!r.failure.ok()) return r.failure;
      if (!error_.ok()) return aborted("broadcast interrupted");
      for (size_t j = 0; j < r.out.size(); ++j)
        if (!r.flight.is_shed(r.tree.children[j])) r.out[j]->send(r.tree.children[j], r.slot, i * kChunkBytes, len);
      r.flight.posted(len, Clock::now());
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !error_.ok() || !r.failure.ok() || r.flight.pending() == 0; });
    if (!r.failure.ok()) return r.failure;
    return error_.ok() ? Status() : aborted("broadcast interrupted");
  }

  // Takes the send completions of child j, in order, for as long as chunks
  // are owed to it; a kick (after a failure) or a failed pair ends it.
  void drain(Running& r, size_t j) {
    const int child = r.tree.children[j];
    try {
      for (size_t k = 0; k < r.chunks; ++k) {
        {
          std::lock_guard<std::mutex> lock(mu_);  // shed, and what it was owed taken: done
          if (r.flight.is_shed(child) && r.flight.child(child)->pending.empty()) return;
        }
        if (!r.out[j]->waitSend(nullptr, kForever)) return;
        std::lock_guard<std::mutex> lock(mu_);
        const auto t = r.flight.taken(child, Clock::now());
        auto& link = links_[static_cast<size_t>(child)];
        link.bytes_sent += t.bytes;
        link.send_busy += t.busy;
        if (r.in && error_.ok()) post_receives_locked(r);
        cv_.notify_all();
      }
    } catch (const std::exception& e) {
      // The pair failed: the child closed (after a goodbye: it left while
      // this broadcast still needed it) or the connection broke.
      std::lock_guard<std::mutex> lock(mu_);
      if (r.flight.is_shed(child) && r.flight.child(child)->pending.empty()) return;  // it closed after its notice
      if (r.failure.ok())
        r.failure = __atomic_load_n(&sentinel_words_[static_cast<size_t>(child)], __ATOMIC_ACQUIRE) == kGoodbye
                        ? aborted(group() + who(child) + " left the group before taking this broadcast (it took " +
                                  format_bytes(r.flight.child(child)->taken_bytes) + " of " + format_bytes(r.bytes) + ")")
                        : peer_lost(group() + "sending to " + who(child) + " failed: " + e.what());
      if (r.in) r.in->abortWaitRecv();  // the runner may be waiting for the parent
      cv_.notify_all();
    }
  }

  // A rank at height h (h levels of the tree below it) waits (h-1) grace
  // steps beyond the stall window before it blames a child: a link stalled
  // deeper down starves every link above it, and the rank right above the
  // stall must be the one that names it.
  Clock::duration stall_grace(const BinomialTree& tree, int root) const {
    int height = 0;
    std::vector<std::pair<int, int>> todo;
    for (int c : tree.children) todo.push_back({c, 1});
    while (!todo.empty()) {
      auto [rank, depth] = todo.back();
      todo.pop_back();
      height = std::max(height, depth);
      for (int c : BinomialTree::of(rank, options_.world_size, root).children) todo.push_back({c, depth + 1});
    }
    return height > 1 ? kStallGrace * (height - 1) : Clock::duration(0);
  }

  Status run_one(const Op& op) {
    Running r;
    r.tree = BinomialTree::of(options_.rank, options_.world_size, op.root);
    r.root = op.root;
    {
      std::lock_guard<std::mutex> lock(mu_);  // a shed child gets nothing more from this communicator
      std::erase_if(r.tree.children, [&](int c) { return shed_.shed(c); });
    }
    r.bytes = op.bytes;
    r.chunks = (op.bytes + kChunkBytes - 1) / kChunkBytes;
    r.slot = ::gloo::Slot::build(kChunkSlotPrefix, op.seq);
    r.stall_grace = stall_grace(r.tree, op.root);
    std::unique_ptr<::gloo::transport::UnboundBuffer> in;
    std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> out;
    std::vector<std::thread> drainers;
    Status status;
    try {
      if (r.tree.parent >= 0) in = context_->createUnboundBuffer(op.data, op.bytes);
      for (size_t j = 0; j < r.tree.children.size(); ++j) out.push_back(context_->createUnboundBuffer(op.data, op.bytes));
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_.ok()) return Status();  // aborted between dequeue and start; already completed
        r.in = in.get();
        for (auto& b : out) r.out.push_back(b.get());
        r.start = Clock::now();
        r.flight = Flight(r.tree.children, r.start);
        running_op_ = &r;
        if (r.in) post_receives_locked(r);
      }
      for (size_t j = 0; j < r.out.size(); ++j) drainers.emplace_back([this, &r, j] { drain(r, j); });
      status = feed(r);
    } catch (const ::gloo::IoException& e) {
      status = peer_lost(group() + "broadcast failed (a connection to a peer broke): " + e.what());
    } catch (const std::exception& e) {
      status = internal_error(std::string("gloo broadcast failed: ") + e.what());
    }
    // The drainers end with the last completion, or at a kick (sticky: a
    // drainer between two waits returns at its next one).
    if (!status.ok())
      for (auto* b : r.out) b->abortWaitSend();
    for (auto& t : drainers) t.join();
    std::lock_guard<std::mutex> lock(mu_);
    running_op_ = nullptr;
    return status;
  }

  void run() {
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) break;
        op = std::move(queue_.front());
        queue_.pop_front();
        running_ = op.state;
      }
      Status status = run_one(op);
      int blame = -1;  // -1: a peer's notice is the cause, nobody is told again
      if (!status.ok()) {
        bool aborted_here;
        {
          std::lock_guard<std::mutex> lock(mu_);
          aborted_here = !error_.ok();
        }
        if (!aborted_here)
          std::tie(status, blame) = cause_of(status, BinomialTree::of(options_.rank, options_.world_size, op.root));
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
  uint32_t next_seq_ = 0;
  std::shared_ptr<WorkState> running_;
  Running* running_op_ = nullptr;  // owned by run_one, registered while its buffers live
  std::vector<LinkStats> links_;   // by peer rank
  ShedWatch shed_;                 // which children this rank shed (guarded by mu_)
  std::vector<NoticeWord> shed_words_;  // the kShed word to each shed child
  std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> shed_notices_;  // watcher thread only
  Status error_;
  bool stop_ = false;
  bool runner_done_ = false;
  std::mutex signal_mu_;  // held while the pairs are signalled, so that every abort() returns after it
  bool signalled_ = false;
  std::thread runner_;
  std::thread watcher_;
};

}  // namespace

StatusOr<std::unique_ptr<Communicator>> create(const GroupOptions& options, Store& store, FormationEvidence* evidence) {
  if (options.device.is_cuda())
    return invalid_argument("gloo backend moves host memory; device " + options.device.to_string() +
                            " needs the nccl backend");
  const std::string where = "gloo group of epoch " + std::to_string(options.epoch) + " (rank " +
                            std::to_string(options.rank) + " of " + std::to_string(options.world_size) + ")";
  try {
    SigpipeBlocked blocked;  // inherited by Gloo's I/O loop thread, started here
    ::gloo::transport::tcp::attr attr;
    if (!options.gloo_interface.empty()) attr.iface = options.gloo_interface;
    else attr.hostname = options.gloo_hostname;
    auto device = ::gloo::transport::tcp::CreateDevice(attr);
    auto mesh = connect_mesh(options.rank, options.world_size, device, store, options.bootstrap + "/",
                             Clock::now() + options.init_timeout, options.members);
    if (!mesh.context) {
      if (evidence) {
        evidence->unreachable = mesh.unreachable;
        evidence->no_address = mesh.no_address;
      }
      return unavailable(where + " could not form: " + mesh.error);
    }
    auto context = std::make_shared<MeshContext>(options.rank, options.world_size, device, std::move(mesh.context));
    context->setTimeout(kForever);  // the watcher bounds every wait (stall_timeout, op_timeout)
    return std::unique_ptr<Communicator>(new GlooCommunicator(options, std::move(context)));
  } catch (const std::exception& e) {
    return unavailable(where + " could not form: " + e.what());
  }
}

}  // namespace paramcast::gloo_backend
