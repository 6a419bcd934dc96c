// RankRun: one rank's run of a many-sender plan as a pipeline of named
// steps, the outline both executors follow (run()):
//
//   choose        this rank's transfers, in schedule order, each with the
//                 buffer its region is in (choose_transfers);
//   send_held     for each piece this rank holds: read (or pack) it from
//                 its buffer, encode it against the baseline, hash it, post
//                 it (and the hashes of the pieces the rank's chains forward);
//                 (the device sends nothing before a batch);
//   per batch     post_batch: the batch's moves posted (the device's sends
//                 read, packed and hashed first: a round is one group);
//                 receive: for each piece that comes: land, check, decode,
//                 place it in the rank's buffer, relay it (the forwards it
//                 brings the bytes of);
//                 end_batch: what the batch left (the device's unpacking)
//                 done, its staging let go;
//   check_forwards the forwards this rank received, against the hashes
//                 their holders sent (chain_start);
//   account       every move waited for, the baseline kept, the stats.
//
// A failure at any step aborts the communicator and lets every posted Work
// settle before its memory goes (settle), the error naming the piece.
//
// The steps that touch memory are each executor's: HostRun
// (executor_host.h: host memory, every move posted at once, deltas) and
// DeviceRun (device_executor.cc: a DeviceMemory, round by round, each round
// one group of moves). This header is theirs only.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <unordered_map>
#include <memory>
#include <string>
#include <vector>

#include "common/reshard/executor.h"

namespace paramcast::reshard::detail {

// One of this rank's transfers, as the schedule orders them.
struct Chosen {
  size_t transfer = 0;  // its index in the plan (its tag)
  size_t round = 0;
  const LocalBuffer* at = nullptr;  // this rank's buffer the region is in (RankBuffers' or the run's found_)
};

// The end of the round that starts at `begin` in a list in schedule order.
template <class Piece>
size_t round_end(const std::vector<Piece>& pieces, size_t begin) {
  size_t end = begin;
  while (end < pieces.size() && pieces[end].round == pieces[begin].round) ++end;
  return end;
}

// Bundles (the host path's dense plans): small pieces between the same pair
// of ranks travel as one message, packed back to back, with one checksum.
inline constexpr uint64_t kBundlePieceMax = 256 << 10;  // a piece's bytes, at most
inline constexpr uint64_t kBundleMax = 4 << 20;         // a bundle's bytes, at most
struct Bundle {
  // A held bundle's: in schedule order. A relay's: its source's order (the
  // bytes are the source's, as they came). The first one's index is the
  // bundle's tag.
  std::vector<size_t> transfers;
  uint64_t bytes = 0;
  bool relay = false;  // forwards, not held pieces
  // A relay's: the index (in the same list) of the bundle whose bytes it
  // forwards, where that bundle is one of this rank's too; else -1.
  long source = -1;
};
// The bundles of `rank`'s pairs. Held: each pair's transfers (from, to), in
// schedule order (the rounds', filtered to that pair), cut into maximal runs
// of held pieces (after < 0) of at most kBundlePieceMax bytes each and
// kBundleMax together; the runs of two or more, ordered by their first
// transfer's place in the schedule. Relays: a bundle (held or a relay)
// whose every piece is forwarded exactly once, all to the same rank, goes
// on as one message too: its bytes as they came, the forwards in its order;
// listed after the bundle they relay. Both ends of a pair derive the same
// bundles of it from the same plan and rounds, without a message (pure).
std::vector<Bundle> plan_bundles(const ReshardPlan& plan, const std::vector<Round>& rounds, int rank);

// Waits a Work of a run that failed (the communicator aborted) for at most
// kSettleTimeout: whether it may still touch its buffer, which must then be
// let go, never freed or reused under a write.
bool unsettled(const std::shared_ptr<Work>& work);

class RankRun {
 public:
  RankRun(const ReshardPlan& plan, const std::vector<Round>& rounds, int rank, Communicator& comm,
          const RankBuffers& buffers, Deadline deadline, const RunOptions& options)
      : plan(plan), rounds(rounds), rank(rank), comm(comm), buffers(buffers), deadline(deadline), options(options) {}
  virtual ~RankRun() = default;
  RankRun(const RankRun&) = delete;
  RankRun& operator=(const RankRun&) = delete;

  // The outline: every step in order; staging that runs out of memory fails
  // the run (out_of_memory), it does not end the process.
  Status run();

 protected:
  // The steps, in the order run() takes them; each executor's own.
  virtual Status choose() = 0;
  virtual Status send_held() = 0;
  virtual size_t batched() const = 0;                  // the pieces the batches walk
  virtual size_t batch_end(size_t begin) const = 0;    // [begin, batch_end) is a batch
  virtual Status post_batch(size_t begin, size_t end) = 0;
  virtual Status receive(size_t piece) = 0;            // land, check, decode, place, relay
  virtual Status end_batch(size_t begin, size_t end) = 0;
  virtual Status check_forwards() = 0;
  virtual Status account() = 0;
  // A failure: the communicator aborted, every posted Work settled (or its
  // memory let go).
  virtual void settle(const Status& s) = 0;
  virtual Status out_of_memory() = 0;

  // Steps both executors share.
  // This rank's transfers in schedule order, each with its buffer; `admit`
  // may refuse one (checked in the same walk).
  StatusOr<std::vector<Chosen>> choose_transfers(const std::function<Status(const Transfer&)>& admit = {}) const;
  // The forwards, in schedule order, whose holder's hash this rank sends
  // (it holds the piece; `sends`) or takes (it receives the forward; `takes`).
  std::vector<size_t> hashed_forwards(bool sends, bool takes) const;
  // Holders' hashes: a piece this rank holds hashed as it went out, and
  // the hash a forward of it is checked against (0 if never sent: a
  // forward always follows its piece).
  void note_held_hash(size_t transfer, uint64_t hash) { held_hashes_[transfer] = hash; }
  uint64_t holders_hash(size_t forward) const;
  // Bytes that crossed this rank's receiving link.
  void count_received(uint64_t wire);
  // The run's stats handed to the caller.
  void report_stats() const {
    if (options.stats) *options.stats = stats;
  }
  // A failure at piece `transfer`: settled, and named.
  Status fail(size_t transfer, Status s) {
    settle(s);
    return about(transfer, std::move(s));
  }
  Status about(size_t transfer, Status s) const;
  // DATA_CORRUPT: piece `transfer`'s `what` bytes ("arrived", "landed", ...)
  // hash `got` by `hash`, not `want`: for a forward checked against its
  // holder's hash, naming both (`holder_sent`: how the holder's value is
  // introduced); else (or `holder_sent` null) the sender's.
  Status mismatch(size_t transfer, const std::string& what, const char* hash, uint64_t got, uint64_t want,
                  const char* holder_sent) const;

  const Transfer& transfer(size_t i) const { return plan.transfers[i]; }
  size_t element(const Transfer& x) const { return dtype_size(plan.tensors[x.tensor].dtype); }
  const std::string& name(const Transfer& x) const { return plan.tensors[x.tensor].name; }
  // The rank that holds the piece transfer `i` carries (its chain's first sender).
  int holder(size_t i) const { return plan.transfers[chain_start(plan, i)].from; }

  const ReshardPlan& plan;
  const std::vector<Round>& rounds;
  const int rank;
  Communicator& comm;
  const RankBuffers& buffers;
  const Deadline deadline;
  const RunOptions& options;
  RunOptions::Stats stats;
  // The buffers RankBuffers::find gave (buffer_of), kept for the run.
  mutable std::deque<LocalBuffer> found_;

 private:
  std::unordered_map<size_t, uint64_t> held_hashes_;  // a transfer this rank sent as holder -> its piece's hash
};

}  // namespace paramcast::reshard::detail
