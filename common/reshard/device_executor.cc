// run_reshard over a DeviceMemory (RunOptions::memory): the path for a GPU's
// memory and NCCL, which launches a rank's moves one at a time in issue
// order unless they are one group.
//
// Round by round, on every rank in the same order (schedule_rounds: in a
// round a rank sends at most one piece and receives at most one, and a
// forward comes in a later round than the piece it relays):
//   1. the round's sends that are not contiguous in the rank's buffer are
//      packed into staging by one batch of the memory's copies (stage);
//      with checksums, each send's xxh64-blocks is taken where its bytes
//      are and put beside them in the memory (hash_send);
//   2. the round's receives and sends are one group (begin_moves/
//      end_moves), each piece followed by its checksum (post_group);
//   3. every move of the round is waited for (land); each landed piece's
//      checksum is checked before it counts (check), then a piece not
//      contiguous in the rank's buffer is unpacked by one batch of copies
//      (place, end_batch), and a piece this rank forwards hands its landing
//      to the forward (relay).
// These are DeviceRun's steps of RankRun's outline (executor_steps.h): a
// round is its batch, and it sends nothing before one (send_held).
// With checksums, a forward's own checksum (its forwarder's, of the bytes
// as they came) checks its hop; after the last round, one more group
// carries the hash of each forwarded piece from the rank that holds it
// (chain_start) to every rank the chain reaches, and each checks what it
// received against it: a forwarder relays bytes, never the hash that checks
// them, so one that changes a piece it forwards is caught by the next rank,
// which names both (check_forwards).
// The rounds are then what the schedule says, with a wait at each: NCCL's
// groups cannot be chained otherwise without a rank waiting on one that
// waits on it. Staging: a round's packed send and the landings a rank
// still has to forward.
#include "common/data/bucket_checksum.h"
#include "common/reshard/executor_steps.h"
#include "common/xxhash.h"

#include <cstdio>
#include <map>
#include <optional>

namespace paramcast::reshard::detail {
namespace {

constexpr Checksum kPieceChecksum = Checksum::kXxh64Blocks;

struct Move : Chosen {
  std::optional<uint64_t> in_place;  // the region's byte offset in the rank's buffer when contiguous
  // Packed bytes (a send) or the landing (a receive) when not in place;
  // shared with the forwards that relay a landing.
  std::shared_ptr<StagingBuffer> staging = std::make_shared<StagingBuffer>();
  StagingBuffer sum;                // the piece's checksum, 8 bytes in the memory
  uint64_t digest = 0;              // a send's checksum as its holder took it; a forward's as it landed here
  const uint8_t* source = nullptr;  // a send's bytes (a forward's: where its piece landed)
  std::shared_ptr<Work> work, sum_work;
  uint8_t* landing() const { return in_place ? at->data + *in_place : staging->data(); }
};

// Closes a group the round opened, also when it unwinds (an exception
// between begin_moves and end_moves would leave the thread's NCCL group open).
struct OpenMoves {
  explicit OpenMoves(Communicator& c) : comm(c) { comm.begin_moves(); }
  ~OpenMoves() {
    if (open) (void)comm.end_moves();
  }
  Status end() {
    open = false;
    return comm.end_moves();
  }
  Communicator& comm;
  bool open = true;
};

// The hash of a forwarded piece in the last group: sent by its holder, or
// taken by the rank the forward reaches (`received`: its move there).
struct HolderHash {
  size_t transfer = 0;
  Move* received = nullptr;  // null: this rank sends the hash
  StagingBuffer at;
  std::shared_ptr<Work> work;
};

class DeviceRun final : public RankRun {
 public:
  using RankRun::RankRun;

 private:
  Status choose() override;
  // A round's sends go with its receives, one group: none before.
  Status send_held() override { return Status(); }
  size_t batched() const override { return all_.size(); }
  size_t batch_end(size_t begin) const override { return round_end(all_, begin); }
  // 1. staging, packing, the sends' checksums; 2. the round's moves, one
  // group; 3. every move waited for.
  Status post_batch(size_t begin, size_t end) override;
  Status stage(Move& m);
  Status hash_send(Move& m);
  Status post_group(size_t begin, size_t end);
  Status land(size_t begin, size_t end);
  // Each landed piece: checked, unpacking queued, handed to its forwards.
  Status receive(size_t piece) override;
  Status check(Move& m);
  void place(const Move& m);
  void relay(Move& m);
  // The round's unpacking, one batch; its memory let go.
  Status end_batch(size_t begin, size_t end) override;
  Status copy_batch(size_t first, const char* what);
  // The last group (checksums): holders' hashes.
  Status check_forwards() override;
  Status post_holders_hashes();
  Status check_against_holders();
  Status account() override {
    report_stats();
    return Status();
  }
  void settle(const Status& s) override;
  Status fail_hash(const HolderHash& hash, Status s);
  Status out_of_memory() override;
  Status allocate(StagingBuffer& into, size_t bytes);

  DeviceMemory& mem_ = *options.memory;
  // This rank's moves in schedule order; `all_` never grows after choose(),
  // so pointers into it stay.
  std::vector<Move> all_;
  std::map<size_t, std::vector<Move*>> forwards_;  // by the transfer that brings their bytes
  std::vector<DeviceMemory::CopyOp> ops_;           // a batch of copies: packing or unpacking
  std::vector<HolderHash> hashes_;                  // beside `all_`: settled by fail_hash, also when the run unwinds
};

// This rank's moves, each with where its region is; a forward must relay
// the region its piece brought.
Status DeviceRun::choose() {
  if (options.delta_base != 0 || options.sent)
    return invalid_argument("many-sender plan on " + comm.device().to_string() +
                            " memory: dense only (no delta base, no sent baseline)");
  auto chosen = choose_transfers([&](const Transfer& x) -> Status {
    if (x.from == rank && x.after >= 0 && transfer(static_cast<size_t>(x.after)).region != x.region)
      return internal_error("many-sender plan: a forward of '" + name(x) + "' " + x.region.to_string() +
                            " relays a different region");
    return Status();
  });
  if (!chosen.ok()) return chosen.status();
  for (const Chosen& c : *chosen) {
    Move m;
    static_cast<Chosen&>(m) = c;
    m.in_place = contiguous_at(m.at->box, transfer(c.transfer).region, element(transfer(c.transfer)));
    all_.push_back(std::move(m));
  }
  for (auto& m : all_) {
    const Transfer& x = transfer(m.transfer);
    if (x.from == rank && x.after >= 0) forwards_[static_cast<size_t>(x.after)].push_back(&m);
  }
  return Status();
}

Status DeviceRun::post_batch(size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i)
    if (Status s = stage(all_[i]); !s.ok()) return s;
  if (Status s = copy_batch(begin, "packing"); !s.ok()) return s;
  if (options.checksums)
    for (size_t i = begin; i < end; ++i)
      if (Status s = hash_send(all_[i]); !s.ok()) return s;
  if (Status s = post_group(begin, end); !s.ok()) return s;
  return land(begin, end);
}

// A move's memory: its checksum's, a receive's landing when not in place,
// a send's bytes (in place, a forward's landing, or packed: queued in the
// round's batch of copies).
Status DeviceRun::stage(Move& m) {
  const Transfer& x = transfer(m.transfer);
  if (options.checksums)
    if (Status s = allocate(m.sum, sizeof(uint64_t)); !s.ok()) return fail(m.transfer, s);
  if (x.to == rank) {
    if (!m.in_place && x.bytes)
      if (Status s = allocate(*m.staging, x.bytes); !s.ok()) return fail(m.transfer, s);
    return Status();
  }
  if (x.after >= 0) {
    if (!m.source) return fail(m.transfer, internal_error("a forward whose bytes never came"));
    return Status();
  }
  if (m.in_place || !x.bytes) {
    m.source = m.at->data + m.in_place.value_or(0);
    return Status();
  }
  if (Status s = allocate(*m.staging, x.bytes); !s.ok()) return fail(m.transfer, s);
  uint8_t* into = m.staging->data();
  for_each_run(m.at->box, x.region, x.region, element(x), [&](uint64_t from, uint64_t to, size_t bytes) {
    ops_.push_back({into + to, m.at->data + from, bytes});
  });
  m.source = into;
  return Status();
}

// A send's checksum taken where its bytes are and put beside them in the
// memory; a piece this rank holds keeps it for its chain's forwards.
Status DeviceRun::hash_send(Move& m) {
  const Transfer& x = transfer(m.transfer);
  if (x.from != rank) return Status();
  auto sum = mem_.checksum(m.source, x.bytes, kPieceChecksum);
  Status s = sum.ok() ? mem_.copy(m.sum.data(), &*sum, sizeof(uint64_t)) : sum.status();
  if (!s.ok()) return fail(m.transfer, s.with_context("checksum"));
  m.digest = *sum;
  if (x.after < 0) note_held_hash(m.transfer, *sum);
  return Status();
}

// The round's moves, one group, each piece followed by its checksum.
Status DeviceRun::post_group(size_t begin, size_t end) {
  OpenMoves group(comm);
  for (size_t i = begin; i < end; ++i) {
    Move& m = all_[i];
    const Transfer& x = transfer(m.transfer);
    const uint32_t tag = static_cast<uint32_t>(m.transfer);
    if (x.to == rank) {
      m.work = comm.recv(m.landing(), x.bytes, x.from, tag);
      if (options.checksums) m.sum_work = comm.recv(m.sum.data(), sizeof(uint64_t), x.from, tag | kChecksumTag);
    } else {
      m.work = comm.send(m.source, x.bytes, x.to, tag);
      if (options.checksums) m.sum_work = comm.send(m.sum.data(), sizeof(uint64_t), x.to, tag | kChecksumTag);
      stats.wire_sent += x.bytes;
      ++stats.dense;
    }
  }
  if (Status s = group.end(); !s.ok()) return fail(all_[begin].transfer, s);
  return Status();
}

Status DeviceRun::land(size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i)
    for (const auto* w : {&all_[i].work, &all_[i].sum_work})
      if (*w)
        if (Status s = (*w)->wait(deadline); !s.ok()) return fail(all_[i].transfer, s);
  return Status();
}

Status DeviceRun::receive(size_t piece) {
  Move& m = all_[piece];
  const Transfer& x = transfer(m.transfer);
  if (x.to != rank) return Status();  // a send: out with the round's group
  if (options.checksums)
    if (Status s = check(m); !s.ok()) return s;
  count_received(x.bytes);
  place(m);
  relay(m);
  return Status();
}

// A landed piece's checksum, where its bytes are, against the one that came
// with them (a forward's: its forwarder's; its holder's comes last).
Status DeviceRun::check(Move& m) {
  const Transfer& x = transfer(m.transfer);
  uint64_t want = 0;
  auto got = mem_.checksum(m.landing(), x.bytes, kPieceChecksum);
  Status s = got.ok() ? mem_.copy(&want, m.sum.data(), sizeof want) : got.status();
  if (!s.ok()) return fail(m.transfer, s.with_context("checksum"));
  if (*got != want)
    return fail(m.transfer, mismatch(m.transfer, "arrived", checksum_name(kPieceChecksum), *got, want, nullptr));
  m.digest = *got;
  return Status();
}

// A piece not contiguous in the rank's buffer: its unpacking queued.
void DeviceRun::place(const Move& m) {
  const Transfer& x = transfer(m.transfer);
  if (m.in_place || !x.bytes) return;
  const uint8_t* from = m.staging->data();
  for_each_run(x.region, m.at->box, x.region, element(x),
               [&](uint64_t f, uint64_t t, size_t bytes) { ops_.push_back({m.at->data + t, from + f, bytes}); });
}

// The forwards of a landed piece send it from where it landed.
void DeviceRun::relay(Move& m) {
  for (Move* f : forwards_[m.transfer]) {
    f->source = m.landing();
    f->staging = m.staging;  // kept while the forward reads it
  }
}

// The round's unpacking, then its memory goes: its sends are out, its
// landings are in place (a forward holds its own share of one it relays).
Status DeviceRun::end_batch(size_t begin, size_t end) {
  if (Status s = copy_batch(begin, "unpacking"); !s.ok()) return s;
  for (size_t i = begin; i < end; ++i) {
    all_[i].staging = std::make_shared<StagingBuffer>();
    all_[i].sum.reset();
  }
  return Status();
}

// The queued copies, one batch of the memory's, waited for.
Status DeviceRun::copy_batch(size_t first, const char* what) {
  if (ops_.empty()) return Status();
  Status s = mem_.copy_many(ops_);
  if (s.ok()) s = mem_.synchronize();
  ops_.clear();
  if (!s.ok()) return fail(all_[first].transfer, s.with_context(what));
  return Status();
}

// The last group (checksums): the holder of each forwarded piece sends its
// hash to every rank the chain reaches, which checks the bytes it received
// against it. Every rank walks the moves in the same order.
Status DeviceRun::check_forwards() {
  if (!options.checksums) return Status();
  for (size_t i : hashed_forwards(/*sends=*/true, /*takes=*/true)) {
    HolderHash hash{i, nullptr, StagingBuffer(), nullptr};
    if (transfer(i).to == rank)
      for (auto& m : all_)
        if (m.transfer == i) hash.received = &m;
    hashes_.push_back(std::move(hash));
  }
  if (hashes_.empty()) return Status();
  if (Status s = post_holders_hashes(); !s.ok()) return s;
  return check_against_holders();
}

Status DeviceRun::post_holders_hashes() {
  for (auto& hash : hashes_) {
    if (Status s = allocate(hash.at, sizeof(uint64_t)); !s.ok()) return fail_hash(hash, s);
    if (hash.received) continue;
    const uint64_t sum = holders_hash(hash.transfer);
    if (Status s = mem_.copy(hash.at.data(), &sum, sizeof sum); !s.ok()) return fail_hash(hash, s);
  }
  OpenMoves group(comm);
  for (auto& hash : hashes_) {
    const uint32_t tag = static_cast<uint32_t>(hash.transfer) | kChecksumTag;
    hash.work = hash.received ? comm.recv(hash.at.data(), sizeof(uint64_t), holder(hash.transfer), tag)
                              : comm.send(hash.at.data(), sizeof(uint64_t), transfer(hash.transfer).to, tag);
  }
  if (Status s = group.end(); !s.ok()) return fail_hash(hashes_.front(), s);
  return Status();
}

Status DeviceRun::check_against_holders() {
  for (auto& hash : hashes_)
    if (Status s = hash.work->wait(deadline); !s.ok()) return fail_hash(hash, s);
  for (auto& hash : hashes_) {
    if (!hash.received) continue;
    uint64_t want = 0;
    if (Status s = mem_.copy(&want, hash.at.data(), sizeof want); !s.ok()) return fail_hash(hash, s);
    if (hash.received->digest != want)
      return fail(hash.received->transfer, mismatch(hash.transfer, "landed", checksum_name(kPieceChecksum),
                                                    hash.received->digest, want, "sent "));
  }
  return Status();
}

// A failure: abort, and let every posted Work settle before its memory
// goes; memory whose Work does not settle is let go, never reused under
// a write (a receive straight into the rank's buffers says so).
void DeviceRun::settle(const Status& s) {
  comm.abort(s.message());
  for (auto& m : all_) {
    bool unsettled_work = false;
    for (const auto* w : {&m.work, &m.sum_work})
      if (unsettled(*w)) unsettled_work = true;
    if (!unsettled_work) continue;
    if (m.in_place && transfer(m.transfer).to == rank && options.unsettled) *options.unsettled = true;
    m.staging->abandon();
    m.sum.abandon();
  }
}

// A failure of the holders' hashes' group: every move and every hash
// settled before their memory goes, the error naming the piece and its holder.
Status DeviceRun::fail_hash(const HolderHash& hash, Status s) {
  settle(s);
  for (auto& h : hashes_)
    if (unsettled(h.work)) h.at.abandon();
  const Transfer& x = transfer(hash.transfer);
  const std::string piece = "'" + name(x) + "' " + x.region.to_string();
  return s.with_context(hash.received ? "many-sender plan: the hash of " + piece + " from rank " +
                                            std::to_string(holder(hash.transfer)) + ", which holds it, to rank " +
                                            std::to_string(rank)
                                      : "many-sender plan: rank " + std::to_string(rank) + " sending the hash of " +
                                            piece + ", which it holds, to rank " + std::to_string(x.to));
}

Status DeviceRun::out_of_memory() {
  const Status s = unavailable("many-sender plan: rank " + std::to_string(rank) + " has no memory for its moves");
  if (!hashes_.empty()) return fail_hash(hashes_.front(), s);  // every posted Work settled (or its memory let go) first
  if (all_.empty()) return s;
  return fail(all_.front().transfer, s);
}

Status DeviceRun::allocate(StagingBuffer& into, size_t bytes) {
  auto p = mem_.allocate(bytes);
  if (!p.ok()) return p.status().with_context("many-sender plan: rank " + std::to_string(rank) + " staging");
  into = StagingBuffer(&mem_, *p, bytes);
  return Status();
}

}  // namespace

Status run_reshard_by_rounds(const ReshardPlan& plan, const std::vector<Round>& rounds, int rank, Communicator& comm,
                             const RankBuffers& buffers, Deadline deadline, const RunOptions& options) {
  return DeviceRun(plan, rounds, rank, comm, buffers, deadline, options).run();
}

}  // namespace paramcast::reshard::detail
