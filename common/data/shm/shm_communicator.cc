// The shm data plane (segment.h for the memory and how it is handed out).
//
// A ring of kSlots slots carries every broadcast in chunks of at most
// slot_bytes. Chunk c (counted over the communicator's life) goes to slot
// c % kSlots: the root waits until every reader consumed chunk c - kSlots,
// copies the chunk in, and publishes it (`published` = c + 1); each reader
// waits for it, copies it out, and says so (`consumed[rank]` = c + 1). The
// root's Work completes once every reader consumed the operation's last
// chunk (delivered, as a broadcast), while it already writes the next
// operation's chunks: buckets stream through the ring back to back.
//
// Waiting: a futex word in the segment, bumped and woken after every
// change; waits are bounded (kPoll) so that each waiter also watches:
//  - the abort word: any rank that fails writes it (the kind and the rank
//    it blames) and wakes everyone; every rank then fails naming that rank;
//  - its peers' liveness: the root checks its readers' pids while it waits
//    for them, a reader the root's (a SIGKILLed peer is named at once);
//  - slowness: a reader that consumes nothing for stall_timeout while the
//    root waits for it fails the group with kTimeout naming it (slow is not
//    dead: any progress restarts the clock);
//  - op_timeout, the backstop.
//
// Point-to-point moves (send/recv) go through the pair's channel in the
// segment, served by a thread of their own (p2p.h); a failure of either ends
// both.
//
// Threads: runner_ runs the broadcasts in order; callers of broadcast()
// queue them. mu_ guards the queue and the error; it is taken before the
// point-to-point plane's lock, never after.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "common/data/shm/futex.h"
#include "common/data/shm/p2p.h"
#include "common/data/shm/segment.h"
#include "common/data/shm/slots.h"
#include "common/data/shm/shm_factory.h"
#include "common/data/work_state.h"
#include "common/log.h"
#include "paramcast/build_config.h"

namespace paramcast::shm_backend {
namespace {

using data_internal::DeadlineWork;
using data_internal::WorkState;

constexpr auto kPoll = std::chrono::milliseconds(10);
constexpr auto kLivenessEvery = std::chrono::milliseconds(100);
enum AbortKind : uint32_t { kFailed = 1, kStalled = 2, kGone = 3 };

uint32_t abort_word(AbortKind kind, int blamed) { return (kind << 24) | (static_cast<uint32_t>(blamed + 1) & 0xffffff); }


// Whether a peer's process still runs: gone (ESRCH) or a zombie (killed,
// not yet reaped by its parent) is dead; anything unknown counts as alive.
bool alive(int32_t pid) {
  if (pid <= 0) return true;
  if (kill(pid, 0) != 0) return errno != ESRCH;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return true;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* paren = std::strrchr(buf, ')');  // "pid (comm) S ...": comm may hold spaces
  return !(paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X'));
}

class HostSlots : public Slots {
 public:
  explicit HostSlots(const Segment& seg) : seg_(seg) {}
  Status put(uint64_t chunk, const uint8_t* src, size_t len) override {
    std::memcpy(seg_.slot(chunk), src, len);
    return Status();
  }
  Status get(uint64_t chunk, uint8_t* dst, size_t len) override {
    std::memcpy(dst, seg_.slot(chunk), len);
    return Status();
  }

 private:
  const Segment& seg_;
};

class ShmCommunicator : public Communicator {
 public:
  ShmCommunicator(const GroupOptions& options, std::unique_ptr<Segment> segment, std::unique_ptr<Slots> slots)
      : options_(options), seg_(std::move(segment)), slots_(std::move(slots)), h_(seg_->header()) {
    if (uint8_t* area = seg_->p2p_area())
      p2p_ = std::make_unique<P2pPlane>(
          options_, area, h_.p2p_wake,
          P2pPlane::Group{[this] { return p2p_failure(); },
                          [this](Status s, int blamed) {
                            const AbortKind kind = s.code() == Code::kPeerLost ? kGone : kFailed;
                            fail(std::move(s), kind, blamed);
                          },
                          [this](int r) { return alive(seg_->peer_pid(r)); }, [this](int r) { return who(r); }});
    runner_ = std::thread([this] { run(); });
  }
  ~ShmCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      // An operation queued, running or being delivered: the peers must not wait for it.
      if (busy_locked() && error_.ok()) fail_locked(aborted("communicator destroyed"), kFailed, options_.rank);
      stop_ = true;
    }
    // Readers waiting for a chunk that will never come stop at once.
    if (options_.rank == 0) h_.closed.store(1, std::memory_order_release);
    cv_.notify_all();
    bump();
    runner_.join();
    if (p2p_) p2p_->stop();  // its thread ends before the segment goes, and before the pointer changes
    p2p_.reset();
  }

  std::shared_ptr<Work> broadcast(void* data, size_t bytes, int root) override {
    auto work = std::make_shared<DeadlineWork>(this, options_.epoch, options_.rank);
    if (bytes == 0) {
      work->state->complete(Status());
      return work;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (root != 0) {
      work->state->complete(invalid_argument("the shm data plane broadcasts from rank 0 only"));
      return work;
    }
    if (!error_.ok()) {
      work->state->complete(aborted("communicator of epoch " + std::to_string(options_.epoch) +
                                    " is unusable: " + error_.to_string()));
      return work;
    }
    queue_.push_back(Op{static_cast<uint8_t*>(data), bytes, work->state, Clock::now() + options_.op_timeout});
    cv_.notify_all();
    return work;
  }

  std::shared_ptr<Work> send(const void* data, size_t bytes, int peer, uint32_t tag) override {
    if (!p2p_) return Communicator::send(data, bytes, peer, tag);
    return p2p_->post(this, const_cast<void*>(data), bytes, peer, tag, true);
  }
  std::shared_ptr<Work> recv(void* data, size_t bytes, int peer, uint32_t tag) override {
    if (!p2p_) return Communicator::recv(data, bytes, peer, tag);
    return p2p_->post(this, data, bytes, peer, tag, false);
  }

  void abort(const std::string& reason) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Idle (nothing queued, running or being delivered): this rank leaves
      // without failing the peers, which may still be finishing their last
      // broadcast (Gloo's goodbye).
      const bool idle = !busy_locked();
      fail_locked(aborted("aborted: " + reason), kFailed, options_.rank, /*tell_peers=*/!idle);
    }
    cv_.notify_all();
    bump();
  }
  Status async_error() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.ok()) check_peers_locked();
    return error_;
  }
  // The point-to-point plane's look at the group: as async_error(), and a
  // reader also stops once the root's communicator is gone.
  Status p2p_failure() {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.ok()) check_peers_locked();
    if (error_.ok() && options_.rank != 0 && h_.closed.load(std::memory_order_acquire))
      fail_locked(aborted("shm data plane: the publisher closed the group"), kFailed, 0, false);
    return error_;
  }
  int stalled_peer() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return stalled_;
  }
  Status order_after(void* stream) override { return slots_->order_after(stream); }
  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  Device device() const override { return options_.device; }

 private:
  struct Op {
    uint8_t* data;
    size_t bytes;
    std::shared_ptr<WorkState> state;
    Deadline deadline;
  };
  // The root's operations whose chunks are all written, waiting for the
  // readers to consume through `end` (a chunk count).
  struct Delivery {
    uint64_t end;
    std::shared_ptr<WorkState> state;
  };

  // "rank 5 (worker-5)", as the other backends name ranks.
  std::string who(int rank) const {
    std::string name = rank >= 0 && rank < static_cast<int>(options_.members.size()) ? options_.members[rank] : "";
    return "rank " + std::to_string(rank) + (name.empty() ? "" : " (" + name + ")");
  }
  void bump() { shm_backend::bump(&h_.futex); }
  // A broadcast queued, running or being delivered, or a point-to-point move
  // pending or wanted by a peer.
  bool busy_locked() const { return busy_ || !queue_.empty() || !deliveries_.empty() || (p2p_ && p2p_->busy()); }

  // The first failure sticks; every pending Work completes with it, and the
  // peers learn whom to blame from the abort word.
  void fail_locked(Status s, AbortKind kind, int blamed, bool tell_peers = true) {
    if (!error_.ok()) return;
    error_ = std::move(s);
    uint32_t expected = 0;
    if (tell_peers) h_.abort_word.compare_exchange_strong(expected, abort_word(kind, blamed));
    for (auto& op : queue_) op.state->complete(error_);
    queue_.clear();
    for (auto& d : deliveries_) d.state->complete(error_);
    deliveries_.clear();
    if (p2p_) p2p_->fail_all(error_);
    // The running operation is completed by the runner once it let go of
    // its buffer (a copy in flight must not outlive its Work).
  }
  // `own_stall`: this root saw `blamed` alone take nothing (stalled_peer()).
  void fail(Status s, AbortKind kind, int blamed, bool own_stall = false) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.ok() && own_stall) stalled_ = blamed;
      fail_locked(std::move(s), kind, blamed);
    }
    bump();
  }
  // A peer's abort word, or a dead peer this rank depends on.
  void check_peers_locked() {
    const uint32_t w = h_.abort_word.load(std::memory_order_acquire);
    if (w != 0) {
      const int blamed = static_cast<int>(w & 0xffffff) - 1;
      const uint32_t kind = w >> 24;
      Status s = kind == kStalled ? timeout_error("shm data plane: the root saw no progress to " + who(blamed) +
                                                  " for stall_timeout")
                 : kind == kGone  ? peer_lost("shm data plane: " + who(blamed) + " is gone (its process exited)")
                                  : aborted("shm data plane: " + who(blamed) + " aborted the group");
      fail_locked(std::move(s), static_cast<AbortKind>(kind), blamed);
    }
  }

  // Waits until `ready()`, or fails (returns false). `readers`: the root
  // waits for its readers (stall and liveness per reader); otherwise a
  // reader waits for the root.
  template <typename Ready>
  bool wait_for(Ready&& ready, Deadline deadline, bool readers) {
    auto last_progress = Clock::now();
    uint64_t last_sum = consumed_sum();
    auto next_liveness = Clock::now() + kLivenessEvery;
    while (true) {
      const uint32_t seen = h_.futex.load(std::memory_order_acquire);
      if (ready()) return true;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (error_.ok()) check_peers_locked();
        if (!error_.ok() || stop_) return false;
        if (!readers && h_.closed.load(std::memory_order_acquire)) {
          fail_locked(aborted("shm data plane: the publisher closed the group"), kFailed, 0, false);
          return false;
        }
      }
      const auto now = Clock::now();
      if (now >= deadline) {
        fail(timeout_error("shm data plane: broadcast of epoch " + std::to_string(options_.epoch) +
                           " did not finish within op_timeout"),
             kFailed, options_.rank);
        return false;
      }
      if (now >= next_liveness) {
        next_liveness = now + kLivenessEvery;
        for (int r = readers ? 1 : 0; r < (readers ? options_.world_size : 1); ++r)
          if (!alive(seg_->peer_pid(r))) {
            fail(peer_lost("shm data plane: " + who(r) + " is gone (its process exited)"), kGone, r);
            return false;
          }
      }
      if (readers) {
        const uint64_t sum = consumed_sum();
        if (sum != last_sum) {
          last_sum = sum;
          last_progress = now;
        } else if (now - last_progress >= options_.stall_timeout) {
          const int r = slowest_reader();
          char figures[96];
          std::snprintf(figures, sizeof figures, "no progress for %.3f s to ", 
                        std::chrono::duration<double>(now - last_progress).count());
          char bound[64];
          std::snprintf(bound, sizeof bound, " (stall_timeout %.3f s)",
                        std::chrono::duration<double>(options_.stall_timeout).count());
          fail(timeout_error("shm data plane: " + std::string(figures) + who(r) + bound), kStalled, r,
               alone_behind(r));
          return false;
        }
      }
      futex_wait(&h_.futex, seen, kPoll);
    }
  }
  uint64_t consumed_sum() const {
    uint64_t s = 0;
    for (int r = 1; r < options_.world_size; ++r) s += h_.consumed[r].load(std::memory_order_acquire);
    return s;
  }
  uint64_t min_consumed() const {
    uint64_t m = UINT64_MAX;
    for (int r = 1; r < options_.world_size; ++r) m = std::min(m, h_.consumed[r].load(std::memory_order_acquire));
    return m;
  }
  // Reader `r` consumed less than every other reader (the others took what
  // the root could give them): the stall is its own.
  // With no other reader there is no such evidence: false.
  bool alone_behind(int r) const {
    const uint64_t mine = h_.consumed[r].load(std::memory_order_acquire);
    bool others = false;
    for (int o = 1; o < options_.world_size; ++o) {
      if (o == r) continue;
      if (h_.consumed[o].load(std::memory_order_acquire) <= mine) return false;
      others = true;
    }
    return others;
  }
  int slowest_reader() const {
    int at = 1;
    for (int r = 2; r < options_.world_size; ++r)
      if (h_.consumed[r].load() < h_.consumed[at].load()) at = r;
    return at;
  }

  // Root: completes the deliveries every reader has consumed.
  void deliver_done() {
    if (options_.world_size == 1) {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& d : deliveries_) d.state->complete(Status());
      deliveries_.clear();
      return;
    }
    const uint64_t done = min_consumed();
    std::lock_guard<std::mutex> lock(mu_);
    while (!deliveries_.empty() && deliveries_.front().end <= done) {
      deliveries_.front().state->complete(Status());
      deliveries_.pop_front();
    }
  }

  void run() {
    const bool root = options_.rank == 0;
    while (true) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (root) {
          // Idle with deliveries outstanding: wait for the readers (below).
          cv_.wait(lock, [&] { return stop_ || !queue_.empty() || !deliveries_.empty(); });
        } else {
          cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        }
        if (stop_) return;
        if (queue_.empty()) {  // root: only deliveries to wait for, until the next operation
          const Deadline deadline = deliveries_deadline_;
          lock.unlock();
          wait_for(
              [&] {
                deliver_done();
                std::lock_guard<std::mutex> l(mu_);
                return deliveries_.empty() || !queue_.empty() || stop_;
              },
              deadline, true);
          continue;
        }
        op = queue_.front();
        queue_.pop_front();
        current_ = op.state;
        busy_ = true;
      }
      const bool ok = root ? write_op(op) : receive(op);
      std::lock_guard<std::mutex> lock(mu_);
      current_.reset();
      busy_ = false;
      if (!ok) {
        op.state->complete(error_.ok() ? aborted("communicator stopped") : error_);
        continue;
      }
      if (!root) op.state->complete(Status());
    }
  }

  // Root: copies op's chunks into the ring as slots free up.
  bool write_op(const Op& op) {
    const uint64_t slot = seg_->slot_bytes();
    ++op_seq_;
    for (size_t off = 0; off < op.bytes; off += slot) {
      const uint64_t c = next_chunk_;
      const uint64_t need = c >= kSlots ? c - kSlots + 1 : 0;  // chunk c - kSlots consumed by every reader
      if (options_.world_size > 1 &&
          !wait_for([&] { deliver_done(); return min_consumed() >= need; }, op.deadline, true))
        return false;
      const size_t len = std::min<uint64_t>(slot, op.bytes - off);
      if (Status s = slots_->put(c, op.data + off, len); !s.ok()) {
        fail(s.with_context("shm data plane: writing chunk " + std::to_string(c)), kFailed, 0);
        return false;
      }
      h_.slot_len[c % kSlots] = len;
      h_.slot_op[c % kSlots] = op_seq_;
      h_.slot_offset[c % kSlots] = off;
      h_.published.store(c + 1, std::memory_order_release);
      next_chunk_ = c + 1;
      bump();
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.ok()) return false;
    deliveries_.push_back(Delivery{next_chunk_, op.state});
    deliveries_deadline_ = op.deadline;
    cv_.notify_all();
    return true;
  }

  // Reader: copies op's chunks out of the ring as they are published.
  bool receive(const Op& op) {
    const uint64_t slot = seg_->slot_bytes();
    ++op_seq_;
    const int me = options_.rank;
    for (size_t off = 0; off < op.bytes; off += slot) {
      const uint64_t c = next_chunk_;
      if (!wait_for([&] { return h_.published.load(std::memory_order_acquire) >= c + 1; }, op.deadline, false))
        return false;
      const size_t len = std::min<uint64_t>(slot, op.bytes - off);
      const uint64_t got_len = h_.slot_len[c % kSlots], got_op = h_.slot_op[c % kSlots],
                     got_off = h_.slot_offset[c % kSlots];
      if (got_len != len || got_op != op_seq_ || got_off != off) {
        fail(protocol_error("shm data plane: chunk " + std::to_string(c) + " is " + std::to_string(got_len) +
                            " bytes at " + std::to_string(got_off) + " of broadcast #" + std::to_string(got_op) +
                            ", this rank expected " + std::to_string(len) + " bytes at " + std::to_string(off) +
                            " of broadcast #" + std::to_string(op_seq_) + " (the ranks' broadcasts differ)"),
             kFailed, me);
        return false;
      }
      if (Status s = slots_->get(c, op.data + off, len); !s.ok()) {
        fail(s.with_context("shm data plane: reading chunk " + std::to_string(c)), kFailed, me);
        return false;
      }
      h_.consumed[me].store(c + 1, std::memory_order_release);
      next_chunk_ = c + 1;
      bump();
    }
    return true;
  }

  const GroupOptions options_;
  std::unique_ptr<Segment> seg_;
  std::unique_ptr<Slots> slots_;
  ShmHeader& h_;
  std::unique_ptr<P2pPlane> p2p_;  // host-memory groups of up to kP2pMaxRanks ranks
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  std::deque<Delivery> deliveries_;
  Deadline deliveries_deadline_{};
  std::shared_ptr<WorkState> current_;
  Status error_;
  int stalled_ = -1;  // stalled_peer(): the reader this root saw alone take nothing
  bool busy_ = false;
  bool stop_ = false;
  uint64_t next_chunk_ = 0;  // runner only
  uint64_t op_seq_ = 0;      // runner only: broadcasts with bytes, counted from 1
  std::thread runner_;
};

}  // namespace

StatusOr<std::string> mint_bootstrap() { return Bootstrap::mint(); }

#if !PARAMCAST_HAVE_NCCL
StatusOr<std::unique_ptr<Slots>> cuda_root_slots(ShmHeader&, Device device) {
  return unavailable("the shm plane on " + device.to_string() + " needs a build with CUDA");
}
StatusOr<std::unique_ptr<Slots>> cuda_reader_slots(const ShmHeader&, Device device) {
  return unavailable("the shm plane on " + device.to_string() + " needs a build with CUDA");
}
#endif

std::unique_ptr<Slots> host_slots(const Segment& segment) { return std::make_unique<HostSlots>(segment); }

StatusOr<std::unique_ptr<Communicator>> create(const GroupOptions& options, Store& store,
                                               FormationEvidence* evidence) {
  (void)store;  // the segment travels over its own socket, named by the bootstrap
  auto b = Bootstrap::parse(options.bootstrap);
  if (!b.ok()) return b.status();
  const bool cuda = options.device.is_cuda();
  // Slots of one bucket each at most, in whole 4 KiB pages.
  const uint64_t slot_bytes = std::max<uint64_t>(4096, (options.shm_slot_bytes + 4095) / 4096 * 4096);
  const std::string where = "rank " + std::to_string(options.rank) + " of epoch " + std::to_string(options.epoch);
  std::unique_ptr<Slots> slots;
  std::vector<int> missing;  // the root's: readers that did not attach
  auto seg = options.rank == 0
                 ? Segment::host(*b, options.world_size, slot_bytes, !cuda, options.init_timeout, options.members,
                                 [&](ShmHeader& h) -> Status {
                                   if (!cuda) return Status();
                                   auto s = cuda_root_slots(h, options.device);  // before any reader sees it
                                   if (!s.ok()) return s.status();
                                   slots = std::move(*s);
                                   return Status();
                                 },
                                 options.shm_rank_secrets, &missing)
                 : Segment::attach(*b, options.rank, options.world_size, options.init_timeout);
  if (evidence) evidence->unreachable.insert(evidence->unreachable.end(), missing.begin(), missing.end());
  if (!seg.ok()) return seg.status().with_context(where);
  if (!slots) {
    if ((*seg)->cuda() != cuda)
      return invalid_argument(where + ": the publisher's shm slots are " +
                              ((*seg)->cuda() ? "CUDA" : "host") + " memory, this rank receives into " +
                              options.device.to_string());
    if (cuda) {
      auto s = cuda_reader_slots((*seg)->header(), options.device);
      if (!s.ok()) return s.status().with_context(where);
      slots = std::move(*s);
    } else {
      slots = host_slots(**seg);
    }
  }
  return std::unique_ptr<Communicator>(new ShmCommunicator(options, std::move(*seg), std::move(slots)));
}

}  // namespace paramcast::shm_backend
