// run_reshard(): one rank's part of a many-sender plan, over a
// Communicator's point-to-point moves.
//
// Every rank of the job computes the same plan (plan_reshard) and its rounds
// (schedule_rounds) from the same manifests, then runs its own transfers:
// every receive posted at once, in schedule order; every send that needs
// no receive first, too; a forward once the receive that brings its bytes
// landed. Each link then carries its bytes back to back, with no barrier
// between rounds (the rounds only order each rank's work). A region that is
// contiguous in the rank's buffer (a row range) moves straight from and
// into it; any other (a column slice: a row-parallel weight's dim-1 cut) is
// packed into staging by the sender and unpacked by the receiver, row by
// row (staging: at most the rank's own bytes). Each transfer's tag is its
// index in the plan, the same on every rank; with checksums, the xxh64 of
// its bytes follows it and its receiver checks them before they count. A
// forwarded piece is checked against the hash of the rank that holds it
// (chain_start), sent straight to each rank the chain reaches after all
// the holder's sends (host memory: all the hashes a holder sends one rank
// in one message, in schedule order), and checked once all the receiver's
// moves landed: a forwarder relays bytes, never the hash that checks them,
// so a member that changes what it forwards is caught by the next one,
// which names both.
// Host memory (the CPU data plane); bounded by `deadline` and by the
// communicator's failure, which names the peer.
//
// Bundles (host memory, dense plans: detail::plan_bundles): a run of
// consecutive held pieces of at most 256 KiB each between the same pair of
// ranks (the pair's transfers in schedule order, 4 MiB together at most)
// travels as one message: packed back to back into staging by the sender,
// tagged with its first piece's index, followed (with checksums) by the
// xxh64 of the packed bytes; the receiver lands it in staging, checks it,
// and unpacks each piece at its own place in the schedule (counting and
// relaying it there). Both ends derive the bundles from the plan and
// rounds, no message needed. A holder still keeps each bundled piece's own
// hash for the ranks its chain reaches. A received bundle whose pieces are
// each forwarded once, all to the same rank, goes on whole as a relay: its
// bytes as they came, once its last piece is placed, taken by the next rank
// at the place of the relay's last forward in the schedule, each piece
// checked there against its holder's hash like any forward. Many small
// tensors then cost a message per bundle, not two per piece and one per
// forward.
//
// Deltas (RunOptions::delta_base): every transfer is announced by a header
// of 32 bytes (tag: its index | kHeaderTag: the encoding, its wire bytes,
// the xxh64 of the piece's new bytes) and carries a delta of its bytes
// against the base version where its sender sent that very piece as that
// version (SentBaseline), else the bytes dense; a piece that did not change
// carries nothing. Each receiver holds the base in the regions it wants
// (the plan's promise, checked by the publisher and by each engine), checks
// the header, applies the delta with every hostile-input check of
// common/delta/ before a byte is written, and checks the hash of the result
// before it counts; a forward relays the header and the wire bytes as they
// came (its receiver holds the same base), and its receiver checks the
// result against the relayed header's hash, then, at the end, against the
// hash the piece's holder sent it (tag | kChecksumTag). A sender's baseline is its own
// pieces only, recorded by every run, dense or delta.
//
// Device memory (RunOptions::memory; device_executor.cc): round by round,
// each round's moves one group (Communicator::begin_moves: NCCL launches a
// rank's moves one at a time otherwise), a round's packing one batch of the
// memory's copies, checksums xxh64-blocks where the bytes are; dense only.
// A forward's bytes are checked, as on the host path, against the hash of
// the rank that holds them (one last group after the rounds).
//
// Steps: the run is one outline on both paths (detail::RankRun,
// executor_steps.h), each step a function of its own: choose this rank's
// transfers; send_held: for each piece it holds, read (or pack) it, encode
// it against the baseline, hash it, post it; then batch by batch (host: a
// dense plan's every receive at once, a delta plan's round; device: a
// round) post_batch, and for each piece that comes, receive: land, check,
// decode, place, relay (post its forwards); check_forwards against their
// holders' hashes; account. The steps that touch memory are the path's:
// HostRun (executor_host.h; executor.cc, executor_send.cc,
// executor_receive.cc) and DeviceRun (device_executor.cc).
//
// Thread-safety: one call at a time per communicator.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <unordered_map>
#include <memory>
#include <vector>

#include "common/data/communicator.h"
#include "common/plan.h"
#include "common/data/device_memory.h"
#include "common/reshard/reshard_plan.h"
#include "common/reshard/schedule.h"
#include "common/reshard/sent_baseline.h"

namespace paramcast::reshard {

// Where this rank keeps a region of a tensor: `data` holds the box `box`
// of it, row-major (the rank's shard, or its slice, or the whole tensor).
struct LocalBuffer {
  uint8_t* data = nullptr;
  Region box;
};

// A rank's buffers by the plan's tensor index, for RankBuffers::find: each
// tensor's first box in a flat table, any further ones (a rank holding
// several boxes of one tensor) beside it; the first box that contains the
// region. A lookup by name for each transfer (hashing and comparing the
// name) was a fifth of an engine's CPU at 50,000 tensors.
class BufferIndex {
 public:
  explicit BufferIndex(size_t tensors) : first_(tensors) {}
  void add(size_t tensor, uint8_t* data, const Region& box);
  // The buffer, where the index keeps it (null if none): read in place.
  const LocalBuffer* locate(size_t tensor, const Region& region) const;
  LocalBuffer find(size_t tensor, const Region& region) const {
    const LocalBuffer* at = locate(tensor, region);
    return at ? *at : LocalBuffer{};
  }

 private:
  std::vector<LocalBuffer> first_;
  std::unordered_multimap<size_t, LocalBuffer> more_;
};

struct RankBuffers {
  // The buffers by the plan's tensor index, read in place (no copy of a
  // box per transfer); where set, `find` is not called.
  std::shared_ptr<const BufferIndex> index;
  // Else: the buffer holding (for a sender) or receiving (for a receiver)
  // the region of the plan's tensor `index` (its spec: `tensor`) that
  // contains `region`; data null if none.
  std::function<LocalBuffer(size_t index, const TensorSpec& tensor, const Region& region)> find;
};

// Copies `region` (inside both boxes) from a row-major buffer of box `from`
// to one of box `to`, `element` bytes per element, run by run.
void copy_region(const uint8_t* src, const Region& from, uint8_t* dst, const Region& to, const Region& region,
                 size_t element);

namespace detail {
struct RankSchedule;
}

struct RunOptions {
  // Each transfer is followed by the xxh64 of its bytes (tag: its index |
  // kChecksumTag), which its receiver checks before it writes them on or
  // forwards them: a difference fails with DATA_CORRUPT naming the tensor,
  // the range and the sender. Every rank of a plan must agree.
  bool checksums = false;
  // Bytes that crossed this rank's receiving link so far (for progress;
  // a delta counts its encoding), updated as receives land.
  std::atomic<uint64_t>* received = nullptr;
  // Set on a failure when a receive straight into the rank's buffers did not
  // settle: the data plane may still write there, so the caller must not
  // free those buffers (staging is let go by run_reshard itself).
  bool* unsettled = nullptr;
  // A rank that only sends holds at most about this many bytes of packed
  // pieces and encodings at once: past it, a send waits for its oldest
  // before it packs or encodes the next (0: no limit). A sender's memory is
  // then its shard, its baseline and this window.
  uint64_t staging_limit = 0;
  // A delta plan: the version every receiver holds in the regions it wants
  // (0: a dense plan), this update's version, and whether a delta goes
  // whenever it is smaller than dense (publisher.delta: always) or only at
  // half the dense bytes or less.
  uint64_t delta_base = 0;
  uint64_t version = 0;
  bool delta_always = false;
  // A sender's baseline of the pieces it sends (null: it keeps none and
  // sends dense): read for a delta plan, recorded by every run.
  SentBaseline* sent = nullptr;
  // The memory the rank's buffers are in (a GPU's), for staging, packing
  // and checksums: the run then goes round by round, each round's moves one
  // group (begin_moves/end_moves), which NCCL needs; dense only (no
  // delta_base, no sent baseline; staging_limit unused: a rank stages at most
  // its round's send and the landings it still forwards), checksums
  // xxh64-blocks. Null: host memory, every move posted at once (the host
  // planes). Every rank of a plan runs the same way; the caller orders both
  // the memory's copies and the communicator after whatever wrote the
  // buffers (DeviceMemory::order_after, Communicator::order_after): packing
  // and checksums read them on the memory's copy stream.
  DeviceMemory* memory = nullptr;
  // Host memory: where this rank keeps its schedule of this plan (its moves
  // in the order it takes them, bundles and relays, whose hashes it sends:
  // a walk of the whole plan, most of a run's cost at 50,000 tensors) for
  // the next run of the same plan object, with the same rank, delta and
  // checksums; anything else derives it afresh. While runs of it come with
  // the same BufferIndex (RankBuffers::index), it also keeps each piece's
  // buffer (no lookup a piece). The slot must live with the plan
  // (ShardedMoves::schedule). Null: derived for this run only.
  std::shared_ptr<const detail::RankSchedule>* schedule = nullptr;
  // What the run did (may be null).
  struct Stats {
    uint64_t wire_sent = 0, wire_received = 0;  // bytes on this rank's links, headers and checksums aside
    size_t dense = 0, delta = 0, unchanged = 0;   // this rank's sends by encoding
    // Point-to-point messages this rank posted (host memory): sends and
    // receives, headers and checksums included.
    size_t messages = 0;
  }* stats = nullptr;
};
inline constexpr uint32_t kChecksumTag = 0x80000000u;
inline constexpr uint32_t kHeaderTag = 0x40000000u;

// Runs `rank`'s transfers of `plan` in the order of `rounds`. Plan ranks
// are the communicator's ranks.
Status run_reshard(const ReshardPlan& plan, const std::vector<Round>& rounds, int rank, Communicator& comm,
                   const RankBuffers& buffers, Deadline deadline, const RunOptions& options = {});

// The memory a rank runs its part of a sharded update over: `device`'s
// (round by round) when its group moves device memory (NCCL), else none
// (host memory, every move posted at once). Every rank of a plan derives it
// from the same group, so all run the same way.
inline DeviceMemory* run_memory(const Communicator& comm, DeviceMemory* device) {
  return comm.device().is_cuda() ? device : nullptr;
}

// The digest of a region a trainer rank holds, which rank 0 compares between
// the ranks that hold the same region (replicas): xxh64 of host bytes, or
// xxh64-blocks where the bytes are when `memory` is a GPU's (every trainer
// rank of a group holds its shards in the same kind of memory).
StatusOr<uint64_t> holding_digest(const void* data, uint64_t bytes, const Device& device, DeviceMemory* memory);

namespace detail {
// The rank's buffer that holds or receives the region of `x`, or an error
// naming the tensor and the region (both executors): where the index keeps
// it, else what `find` gave, kept in `found` (which must outlive its use).
StatusOr<const LocalBuffer*> buffer_of(const ReshardPlan& plan, const RankBuffers& buffers, const Transfer& x,
                                       int rank, std::deque<LocalBuffer>& found);
// run_reshard's path for RunOptions::memory (device_executor.cc).
Status run_reshard_by_rounds(const ReshardPlan& plan, const std::vector<Round>& rounds, int rank, Communicator& comm,
                             const RankBuffers& buffers, Deadline deadline, const RunOptions& options);
}  // namespace detail

}  // namespace paramcast::reshard
