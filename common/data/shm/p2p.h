// Point-to-point moves on the shm plane: Communicator::send/recv between any
// two ranks of one host's group (the many-sender plan's moves), through one
// channel per ordered pair of ranks in the group's segment (segment.h).
//
// A channel (from -> to) is a control page and kP2pChunks chunks of
// kP2pChunkBytes. The receiver posts its receives from that peer, in the
// order it issued them, as wants (tag, bytes) in a ring in the control page;
// the sender takes the wants in that order, each once a send of that tag is
// queued on its side (the sizes must agree), and streams the send's bytes
// through the chunks; each chunk says which tag it carries, where and how
// long, and the receiver checks that against the receive it expects before
// copying out. So no byte is written where no receive waits for it, sizes
// are checked before any byte moves, and the operations of one pair
// complete in the order the receiver posted them. The sender serves the
// wants strictly in that order: a send the sender would issue only after
// one the receiver posted later completes would wait for its deadline (the
// many-sender executor never does that: on every pair both sides go round
// by round).
//
// One thread, started at the first operation, serves every channel of this
// rank, waiting on its own futex word in the segment's header (a change on a
// channel wakes only its other end). It watches the group's failure
// (the abort word, the root's closing, through the communicator), every
// operation's op_timeout, and the liveness of the peers whose pid this rank
// knows (the root knows every reader's, a reader the root's). Any rank that
// holds the segment may write anything in a channel's control page: every
// value read from it is checked before use (an index never leaves its ring,
// a length is never taken from it), and one that does not fit fails the
// group blaming the channel's other end, whose word it is.
//
// Thread-safety: post(), fail_all() and busy() from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/data/communicator.h"
#include "common/data/work_state.h"

namespace paramcast::shm_backend {

class P2pPlane {
 public:
  // What the communicator lends its point-to-point plane.
  struct Group {
    std::function<Status()> failure;              // the group's failure, OK while it is usable
    std::function<void(Status, int)> fail;        // fails the group, blaming a rank
    std::function<bool(int)> alive;               // a peer's process still runs (true when unknown)
    std::function<std::string(int)> who;          // "rank 3 (worker-3)"
  };
  // `area`: the segment's channels (p2p_area_bytes); `wake`: each rank's
  // futex word (ShmHeader::p2p_wake): a rank waits on its own, and wakes a
  // peer on the peer's after each change the peer may wait for.
  P2pPlane(const GroupOptions& options, uint8_t* area, std::atomic<uint32_t>* wake, Group group);
  ~P2pPlane();  // stop()
  // Ends the thread; what is still pending completes with kAborted.
  void stop();

  // Communicator::send (send) or recv; `comm` aborts at a missed deadline.
  std::shared_ptr<Work> post(Communicator* comm, void* data, size_t bytes, int peer, uint32_t tag, bool send);
  // The group failed: every pending operation completes with `error` (the
  // thread completes them, once it no longer touches their buffers).
  void fail_all(const Status& error);
  // Operations queued or in flight here, or a receive a peer posted that
  // this rank has not taken yet (a peer waits on it: this rank's leaving
  // must fail the group, not leave that peer waiting).
  bool busy() const;

 private:
  struct Op {
    bool send = false;
    int peer = -1;
    uint32_t tag = 0;
    uint8_t* data = nullptr;
    size_t bytes = 0;
    size_t done = 0;
    std::shared_ptr<data_internal::WorkState> state;
    Deadline deadline;
  };
  using OpPtr = std::shared_ptr<Op>;
  struct Control;
  // Per peer, owned by the thread.
  struct Peer {
    std::deque<OpPtr> sends;     // queued, waiting for the peer's want
    OpPtr sending;               // taken: its bytes going through the channel
    std::deque<OpPtr> unposted;  // receives not yet posted as wants (the ring was full)
    std::deque<OpPtr> posted;    // posted, the front one receiving
  };

  Control& control(int from, int to) const;
  uint8_t* chunk(int from, int to, uint64_t index) const;
  void run();
  bool serve_out(int peer, Peer& p);
  bool serve_in(int peer, Peer& p);
  bool watch(std::chrono::steady_clock::time_point& next_liveness);
  void complete_all(const Status& error);
  void finish(OpPtr& op, const Status& status);

  const GroupOptions options_;
  uint8_t* const area_;
  std::atomic<uint32_t>* const wake_;
  const Group group_;
  std::atomic<int> pending_{0};
  std::vector<Peer> peers_;  // thread only
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<OpPtr> incoming_;  // posted by callers, not yet the thread's
  Status error_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace paramcast::shm_backend
