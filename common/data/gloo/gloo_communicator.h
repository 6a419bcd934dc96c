// GlooCommunicator: the Gloo data plane's Communicator. Internal to data/gloo;
// gloo_factory.h creates it. Its parts are three rooms:
//
//  - gloo_communicator.cc: the lifecycle (threads, create(), destruction),
//    the public calls and the runner's loop.
//  - tree_schedule.cc, the stream: broadcasts move down a binomial tree
//    (tree.h) in chunks (schedule.h), one broadcast after the other as one
//    stream of chunks. A rank forwards each chunk to its children as soon as
//    it landed, at most kWindowBytes ahead of what each child has taken,
//    and the next broadcast's chunks follow the current one's without the
//    tree draining in between: a non-root rank posts a broadcast's receives
//    when it is issued (within the window), so its parent streams into it
//    while it still forwards the previous one. The runner receives and
//    forwards; one drainer thread per child takes the send completions
//    (flight.h) and completes each broadcast when the last of its bytes left.
//  - abort.cc, the failure path: the watcher (stalled links, peers' notices,
//    broken connections, shedding), fail() and the signalling that makes an
//    abort win over every Gloo wait; sentinels.h carries the notices.
//
// Slow is not dead. A broadcast fails for slowness only when a link this
// rank sends on takes nothing for stall_timeout: the watcher sees it and
// fails the group with kTimeout naming that link. Receives wait as long as
// the sender keeps its links moving (the sender is the one that sees a
// stalled link; a parent may be waiting, legitimately, for a slow sibling),
// bounded only by op_timeout and the caller's deadline. Per-link bytes and
// busy time give each link's rate (link_stats()).
//
// An abort that wins. Gloo's TCP pairs fail a pending wait only for some
// failures, and a wait whose send is already on the wire sleeps until
// Gloo's own timeout. So:
//  - abort(), and any failure this rank sees, signals every pair with an
//    exception (as Gloo does on its own timeout): each pair's socket is
//    closed under the pair's lock, and every buffer with a pending receive
//    is woken. Only then do the pending Works complete with the error: once
//    a Work reports the failure, or abort() returns, no Gloo I/O reads into
//    or writes from an operation's memory, so its buffers may be freed.
//  - before it closes, a rank tells every peer why (sentinels.h): the rank
//    blamed for an abort (while an operation is issued and not complete, or
//    for a failed one) and whether it was a stall, or a goodbye (a rank
//    leaving while idle: peers may still be finishing their last broadcast).
//  - the watcher polls, every kWatchInterval, for notices, for a stalled
//    link, and, while an operation is issued, for a connection to its parent
//    or children in the tree that ended without a word (a killed peer);
//    each aborts the communicator naming the rank.
//  - after an abort, the watcher (and the destructor) kick the operations'
//    buffers (abortWaitRecv/abortWaitSend) until every thread's Gloo call
//    returned: their Works completed with the error when abort() ran.
// The destructor therefore ends within a few watch intervals; it is still run
// on a reaper thread (common/data/reaper.h), never by a control thread.
//
//  - p2p.cc, point-to-point: send() and recv() post an unbound buffer on a
//    slot of their own (kP2pSlotPrefix and the tag); one thread per peer
//    and direction takes the completions in issue order. A failed pair, or
//    the communicator's failure, fails them as it fails broadcasts.
//
// Threads: runner_ receives and posts sends, in stream order; one drainer per
// child takes send completions; one completer per point-to-point peer and
// direction; watcher_ polls (abort.cc); callers of broadcast(), send() and
// recv() post their buffers. mu_ guards the operations, the stream, the link
// figures and the errors. mu_ may be held while posting to Gloo or calling a
// buffer's abortWait*; Gloo never calls back into this class.
#pragma once

#include <gloo/rendezvous/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/data/communicator.h"
#include "common/data/gloo/flight.h"
#include "common/data/gloo/sentinels.h"
#include "common/data/gloo/shed.h"
#include "common/data/gloo/tree.h"
#include "common/data/work_state.h"

namespace paramcast::gloo_backend {

using Clock = std::chrono::steady_clock;

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(const GroupOptions& options, std::shared_ptr<::gloo::rendezvous::Context> context);
  ~GlooCommunicator() override;

  std::shared_ptr<Work> broadcast(void* data, size_t bytes, int root) override;
  std::shared_ptr<Work> send(const void* data, size_t bytes, int peer, uint32_t tag) override;
  std::shared_ptr<Work> recv(void* data, size_t bytes, int peer, uint32_t tag) override;
  void abort(const std::string& reason) override;
  Status async_error() override;
  std::vector<LinkStats> link_stats() override;
  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  Device device() const override { return Device::cpu(); }

 private:
  // One broadcast, from broadcast() until its Work completes (or, failed,
  // until the communicator is destroyed: its buffers stay registered so that
  // kicks reach every wait on them).
  struct Op {
    uint8_t* data = nullptr;
    size_t bytes = 0;
    int root = 0;
    uint32_t seq = 0;  // the same on every rank: the chunk slot
    std::shared_ptr<data_internal::WorkState> state;
    size_t chunk = 0;
    size_t chunks = 0;
    uint64_t slot = 0;
    int parent = -1;
    std::unique_ptr<::gloo::transport::UnboundBuffer> in;  // receives from the parent
    // Set when the runner starts it: the children it is sent to, one buffer each.
    std::vector<int> children;
    std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> out;
    uint64_t first = 0;        // stream offset of its first byte (valid once joined)
    bool joined = false;       // in the stream: its receives may be posted
    size_t recvs_posted = 0;
    bool started = false;      // the runner forwards it
    bool forwarded = false;    // every chunk received and posted to the children
    size_t owed = 0;           // sends posted and not yet taken
    bool done = false;         // its Work completed
    Clock::time_point start;

    size_t chunk_len(size_t i) const { return std::min(chunk, bytes - i * chunk); }
    ::gloo::transport::UnboundBuffer* out_to(int child) const {
      for (size_t j = 0; j < children.size(); ++j)
        if (children[j] == child) return out[j].get();
      return nullptr;
    }
  };

  // One point-to-point send or receive (p2p.cc), until its Work completes
  // (failed ones stay, as broadcasts do, so that kicks reach their waits).
  struct P2p {
    std::unique_ptr<::gloo::transport::UnboundBuffer> buffer;
    bool send = false;
    int peer = -1;
    size_t bytes = 0;
    std::shared_ptr<data_internal::WorkState> state;
    bool done = false;
  };
  using P2pKey = std::pair<int, bool>;  // peer, send

  // The stream the issued broadcasts move in: one root, its tree, and the
  // flight of chunks posted to this rank's children. A broadcast with
  // another root starts a new stream once this one drained.
  struct Stream {
    int root = 0;
    BinomialTree tree;  // children: those not shed when the stream began
    Flight flight;
    uint64_t next = 0;  // stream offset of the next broadcast's first byte
    Clock::duration stall_grace{0};
  };

  // What a rank tells its peers before it closes. kIfBusy: an abort if an
  // operation is issued and not complete, else a goodbye (a member that
  // leaves after its last broadcast must not break the peers still
  // finishing theirs). kNever: nothing (the rank reacts to a peer's notice).
  enum class Notify { kNever, kIfBusy, kAlways };

  // gloo_communicator.cc
  void run();
  std::string who(int rank) const;
  std::string group() const;

  // tree_schedule.cc
  void report_failure_locked(Status failure);
  void join_locked(Op& op);
  void begin_stream_locked(int root);
  void post_receives_locked();
  Status forward(const std::shared_ptr<Op>& op);
  void start_locked(Op& op);
  void drain(int child);
  void ensure_drainers_locked();
  void complete_if_done_locked(Op& op);
  std::shared_ptr<Op> find_locked(uint32_t seq) const;
  Clock::duration stall_grace(const BinomialTree& tree, int root) const;
  std::vector<int> shed_locked(Clock::time_point now);
  std::vector<int> stream_peers_locked() const;
  bool busy_locked() const;

  // p2p.cc
  std::shared_ptr<Work> p2p(void* data, size_t bytes, int peer, uint32_t tag, bool send);
  void complete_p2p(P2pKey key);

  // abort.cc
  void fail(const Status& why, Notify mode, int blame, NoticeKind kind = kFailed);
  void signal_pairs();
  void kick_locked();
  void watch();
  Status notice_status(const Sentinels::Notice& n) const;
  // The first notice a peer could have sent (forged_notice); a forged one is
  // logged once per sender and ignored.
  Sentinels::Notice next_notice();
  std::set<int> forged_senders();
  std::string forged_notice(const Sentinels::Notice& n) const;
  std::pair<Status, int> stalled_locked(Clock::time_point now);
  std::pair<Status, int> cause_of(const Status& failure);

  const GroupOptions options_;
  const size_t max_chunk_;          // schedule.h: the same on every rank
  const uint64_t receive_window_;   // schedule.h: this rank's own
  std::shared_ptr<::gloo::rendezvous::Context> context_;
  Sentinels sentinels_;
  // The root of the broadcasts (the publisher: rank 0 until a stream says
  // otherwise), for judging notices; and the peers whose forged notice was
  // logged (forged_mu_).
  std::atomic<int> notice_root_{0};
  std::mutex forged_mu_;
  std::set<int> forged_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Op>> ops_;  // issued, in order; completed ones leave (failed ones stay)
  uint32_t next_seq_ = 0;
  std::optional<Stream> stream_;
  std::map<int, std::thread> drainers_;  // by child rank
  // Point-to-point operations not yet complete, in issue order per peer and
  // direction, and the thread that completes each queue's.
  std::map<P2pKey, std::deque<std::shared_ptr<P2p>>> p2p_;
  std::map<P2pKey, std::thread> p2p_threads_;
  std::vector<LinkStats> links_;         // by peer rank
  ShedWatch shed_;                       // which children this rank shed
  Status failure_;  // a drainer's: the pair to its child failed (the runner reports it)
  Status error_;    // the communicator's: set once, every later operation fails with it
  bool stop_ = false;
  bool runner_done_ = false;
  std::mutex signal_mu_;  // held while the pairs are signalled, so that every abort() returns after it
  bool signalled_ = false;
  std::thread runner_;
  std::thread watcher_;
};

}  // namespace paramcast::gloo_backend
