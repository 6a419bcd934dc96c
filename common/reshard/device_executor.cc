// run_reshard over a DeviceMemory (RunOptions::memory): the path for a GPU's
// memory and NCCL, which launches a rank's moves one at a time in issue
// order unless they are one group.
//
// Round by round, on every rank in the same order (schedule_rounds: in a
// round a rank sends at most one piece and receives at most one, and a
// forward comes in a later round than the piece it relays):
//   1. the round's sends that are not contiguous in the rank's buffer are
//      packed into staging by one batch of the memory's copies; with
//      checksums, each send's xxh64-blocks is taken where its bytes are
//      and put beside them in the memory;
//   2. the round's receives and sends are one group (begin_moves/
//      end_moves), each piece followed by its checksum;
//   3. every move of the round is waited for; each landed piece's checksum
//      is checked before it counts, then a piece not contiguous in the
//      rank's buffer is unpacked by one batch of copies, and a piece this
//      rank forwards hands its landing to the forward.
// With checksums, a forward's own checksum (its forwarder's, of the bytes
// as they came) checks its hop; after the last round, one more group
// carries the hash of each forwarded piece from the rank that holds it
// (chain_start) to every rank the chain reaches, and each checks what it
// received against it: a forwarder relays bytes, never the hash that checks
// them, so one that changes a piece it forwards is caught by the next rank,
// which names both.
// The rounds are then what the schedule says, with a wait at each: NCCL's
// groups cannot be chained otherwise without a rank waiting on one that
// waits on it. Staging: a round's packed send and the landings a rank
// still has to forward.
#include "common/data/bucket_checksum.h"
#include "common/reshard/executor.h"
#include "common/xxhash.h"

#include <cstdio>
#include <map>
#include <optional>

namespace paramcast::reshard::detail {
namespace {

constexpr Checksum kPieceChecksum = Checksum::kXxh64Blocks;

struct Move {
  size_t transfer = 0;
  size_t round = 0;
  LocalBuffer at;                     // the rank's buffer the region is in
  std::optional<uint64_t> in_place;   // the region's byte offset there when contiguous
  // Packed bytes (a send) or the landing (a receive) when not in place;
  // shared with the forwards that relay a landing.
  std::shared_ptr<StagingBuffer> staging = std::make_shared<StagingBuffer>();
  StagingBuffer sum;                  // the piece's checksum, 8 bytes in the memory
  uint64_t digest = 0;                // a send's checksum as its holder took it; a forward's as it landed here
  const uint8_t* source = nullptr;    // a send's bytes (a forward's: where its piece landed)
  std::shared_ptr<Work> work, sum_work;
  uint8_t* landing() const { return in_place ? at.data + *in_place : staging->data(); }
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

}  // namespace

Status run_reshard_by_rounds(const ReshardPlan& plan, const std::vector<Round>& rounds, int rank, Communicator& comm,
                             const RankBuffers& buffers, Deadline deadline, const RunOptions& options) {
  DeviceMemory& mem = *options.memory;
  if (options.delta_base != 0 || options.sent)
    return invalid_argument("many-sender plan on " + comm.device().to_string() +
                            " memory: dense only (no delta base, no sent baseline)");
  RunOptions::Stats stats;
  auto element = [&](const Transfer& x) { return dtype_size(plan.tensors[x.tensor].dtype); };
  auto name = [&](const Transfer& x) -> const std::string& { return plan.tensors[x.tensor].name; };
  auto allocate = [&](StagingBuffer& into, size_t bytes) -> Status {
    auto p = mem.allocate(bytes);
    if (!p.ok()) return p.status().with_context("many-sender plan: rank " + std::to_string(rank) + " staging");
    into = StagingBuffer(&mem, *p, bytes);
    return Status();
  };

  // This rank's moves in schedule order; `all` never grows after this, so
  // pointers into it stay.
  std::vector<Move> all;
  std::map<size_t, std::vector<Move*>> forwards;  // by the transfer that brings their bytes
  for (size_t k = 0; k < rounds.size(); ++k)
    for (size_t i : rounds[k].transfers) {
      const Transfer& x = plan.transfers[i];
      if (x.from != rank && x.to != rank) continue;
      Move m;
      m.transfer = i;
      m.round = k;
      auto at = buffer_of(plan, buffers, x, rank);
      if (!at.ok()) return at.status();
      m.at = *at;
      if (x.from == rank && x.after >= 0 && plan.transfers[static_cast<size_t>(x.after)].region != x.region)
        return internal_error("many-sender plan: a forward of '" + name(x) + "' " + x.region.to_string() +
                              " relays a different region");
      m.in_place = contiguous_at(m.at.box, x.region, element(x));
      all.push_back(std::move(m));
    }
  for (auto& m : all) {
    const Transfer& x = plan.transfers[m.transfer];
    if (x.from == rank && x.after >= 0) forwards[static_cast<size_t>(x.after)].push_back(&m);
  }

  // A failure: abort, and let every posted Work settle before its memory
  // goes; memory whose Work does not settle is let go, never reused under
  // a write (a receive straight into the rank's buffers says so).
  auto settle = [&](const Status& s) {
    comm.abort(s.message());
    for (auto& m : all) {
      bool unsettled = false;
      for (const auto* w : {&m.work, &m.sum_work})
        if (*w && ((*w)->wait(Clock::now() + kSettleTimeout).code() == Code::kTimeout || !(*w)->settled()))
          unsettled = true;
      if (!unsettled) continue;
      if (m.in_place && plan.transfers[m.transfer].to == rank && options.unsettled) *options.unsettled = true;
      m.staging->abandon();
      m.sum.abandon();
    }
  };
  auto fail = [&](const Move& at, Status s) {
    settle(s);
    const Transfer& x = plan.transfers[at.transfer];
    return s.with_context("many-sender plan: '" + name(x) + "' " + x.region.to_string() + " from rank " +
                          std::to_string(x.from) + " to rank " + std::to_string(x.to));
  };

  // The last group (checksums): the holder of each forwarded piece sends
  // its hash to every rank the chain reaches, which checks the bytes it
  // received against it. Every rank walks the moves in the same order.
  auto holder = [&](size_t i) { return plan.transfers[chain_start(plan, i)].from; };
  struct Sum {
    size_t transfer = 0;
    Move* received = nullptr;  // null: this rank sends the hash
    StagingBuffer at;
    std::shared_ptr<Work> work;
  };
  std::vector<Sum> sums;  // beside `all`: settled by fail_sum, also when the run unwinds
  // A failure of the hashes' group: every move and every hash settled
  // before their memory goes, the error naming the piece and its holder.
  auto fail_sum = [&](const Sum& sum, Status s) {
    settle(s);
    for (auto& h : sums)
      if (h.work && ((h.work->wait(Clock::now() + kSettleTimeout).code() == Code::kTimeout) || !h.work->settled()))
        h.at.abandon();
    const Transfer& x = plan.transfers[sum.transfer];
    const std::string piece = "'" + name(x) + "' " + x.region.to_string();
    return s.with_context(sum.received ? "many-sender plan: the hash of " + piece + " from rank " +
                                             std::to_string(holder(sum.transfer)) + ", which holds it, to rank " +
                                             std::to_string(rank)
                                       : "many-sender plan: rank " + std::to_string(rank) + " sending the hash of " +
                                             piece + ", which it holds, to rank " + std::to_string(x.to));
  };
  auto holders_hashes = [&]() -> Status {
    std::map<size_t, uint64_t> hash_of;  // a piece this rank sent as its holder -> its hash
    for (const auto& m : all)
      if (plan.transfers[m.transfer].from == rank && plan.transfers[m.transfer].after < 0)
        hash_of[m.transfer] = m.digest;
    for (size_t k = 0; k < rounds.size(); ++k)
      for (size_t i : rounds[k].transfers) {
        const Transfer& x = plan.transfers[i];
        if (x.after < 0) continue;
        if (x.to != rank && holder(i) != rank) continue;
        Sum sum{i, nullptr, StagingBuffer(), nullptr};
        if (x.to == rank)
          for (auto& m : all)
            if (m.transfer == i) sum.received = &m;
        sums.push_back(std::move(sum));
      }
    if (sums.empty()) return Status();
    for (auto& sum : sums) {
      if (Status s = allocate(sum.at, sizeof(uint64_t)); !s.ok()) return fail_sum(sum, s);
      if (sum.received) continue;
      const auto it = hash_of.find(chain_start(plan, sum.transfer));
      const uint64_t hash = it == hash_of.end() ? 0 : it->second;  // always sent earlier (a forward follows its piece)
      if (Status s = mem.copy(sum.at.data(), &hash, sizeof hash); !s.ok()) return fail_sum(sum, s);
    }
    {
      OpenMoves group(comm);
      for (auto& sum : sums) {
        const Transfer& x = plan.transfers[sum.transfer];
        const uint32_t tag = static_cast<uint32_t>(sum.transfer) | kChecksumTag;
        sum.work = sum.received ? comm.recv(sum.at.data(), sizeof(uint64_t), holder(sum.transfer), tag)
                                : comm.send(sum.at.data(), sizeof(uint64_t), x.to, tag);
      }
      if (Status s = group.end(); !s.ok()) return fail_sum(sums.front(), s);
    }
    for (auto& sum : sums)
      if (Status s = sum.work->wait(deadline); !s.ok()) return fail_sum(sum, s);
    for (auto& sum : sums) {
      if (!sum.received) continue;
      uint64_t want = 0;
      if (Status s = mem.copy(&want, sum.at.data(), sizeof want); !s.ok()) return fail_sum(sum, s);
      const Transfer& x = plan.transfers[sum.transfer];
      if (sum.received->digest != want)
        return fail(*sum.received,
                    data_corrupt(std::to_string(x.bytes) + " bytes landed with " + checksum_name(kPieceChecksum) + " " +
                                 digest_hex(sum.received->digest) + " as rank " + std::to_string(x.from) +
                                 " forwarded them; rank " + std::to_string(holder(sum.transfer)) +
                                 ", which holds them, sent " + digest_hex(want)));
    }
    return Status();
  };

  auto run = [&]() -> Status {
    std::vector<DeviceMemory::CopyOp> ops;
    for (size_t begin = 0; begin < all.size();) {
      size_t end = begin;
      while (end < all.size() && all[end].round == all[begin].round) ++end;
      // 1. Staging, packing and the sends' checksums.
      ops.clear();
      for (size_t i = begin; i < end; ++i) {
        Move& m = all[i];
        const Transfer& x = plan.transfers[m.transfer];
        if (options.checksums)
          if (Status s = allocate(m.sum, sizeof(uint64_t)); !s.ok()) return fail(m, s);
        if (x.to == rank) {
          if (!m.in_place && x.bytes)
            if (Status s = allocate(*m.staging, x.bytes); !s.ok()) return fail(m, s);
          continue;
        }
        if (x.after >= 0) {
          if (!m.source) return fail(m, internal_error("a forward whose bytes never came"));
          continue;
        }
        if (m.in_place || !x.bytes) {
          m.source = m.at.data + m.in_place.value_or(0);
          continue;
        }
        if (Status s = allocate(*m.staging, x.bytes); !s.ok()) return fail(m, s);
        uint8_t* into = m.staging->data();
        for_each_run(m.at.box, x.region, x.region, element(x), [&](uint64_t from, uint64_t to, size_t bytes) {
          ops.push_back({into + to, m.at.data + from, bytes});
        });
        m.source = into;
      }
      if (!ops.empty()) {
        Status s = mem.copy_many(ops);
        if (s.ok()) s = mem.synchronize();
        if (!s.ok()) return fail(all[begin], s.with_context("packing"));
      }
      if (options.checksums)
        for (size_t i = begin; i < end; ++i) {
          Move& m = all[i];
          const Transfer& x = plan.transfers[m.transfer];
          if (x.from != rank) continue;
          auto sum = mem.checksum(m.source, x.bytes, kPieceChecksum);
          Status s = sum.ok() ? mem.copy(m.sum.data(), &*sum, sizeof(uint64_t)) : sum.status();
          if (!s.ok()) return fail(m, s.with_context("checksum"));
          m.digest = *sum;
        }
      // 2. The round's moves, one group.
      OpenMoves group(comm);
      for (size_t i = begin; i < end; ++i) {
        Move& m = all[i];
        const Transfer& x = plan.transfers[m.transfer];
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
      if (Status s = group.end(); !s.ok()) return fail(all[begin], s);
      // 3. Waited for, checked, unpacked, handed on.
      for (size_t i = begin; i < end; ++i)
        for (const auto* w : {&all[i].work, &all[i].sum_work})
          if (*w)
            if (Status s = (*w)->wait(deadline); !s.ok()) return fail(all[i], s);
      ops.clear();
      for (size_t i = begin; i < end; ++i) {
        Move& m = all[i];
        const Transfer& x = plan.transfers[m.transfer];
        if (x.to != rank) continue;
        if (options.checksums) {
          uint64_t want = 0;
          auto got = mem.checksum(m.landing(), x.bytes, kPieceChecksum);
          Status s = got.ok() ? mem.copy(&want, m.sum.data(), sizeof want) : got.status();
          if (!s.ok()) return fail(m, s.with_context("checksum"));
          if (*got != want)
            return fail(m, data_corrupt(std::to_string(x.bytes) + " bytes arrived with " + checksum_name(kPieceChecksum) +
                                        " " + digest_hex(*got) + ", the sender's " + digest_hex(want)));
          m.digest = *got;
        }
        stats.wire_received += x.bytes;
        if (options.received) *options.received += x.bytes;
        if (!m.in_place && x.bytes) {
          const uint8_t* from = m.staging->data();
          for_each_run(x.region, m.at.box, x.region, element(x), [&](uint64_t f, uint64_t t, size_t bytes) {
            ops.push_back({m.at.data + t, from + f, bytes});
          });
        }
        for (Move* f : forwards[m.transfer]) {
          f->source = m.landing();
          f->staging = m.staging;  // kept while the forward reads it
        }
      }
      if (!ops.empty()) {
        Status s = mem.copy_many(ops);
        if (s.ok()) s = mem.synchronize();
        if (!s.ok()) return fail(all[begin], s.with_context("unpacking"));
      }
      // The round's memory goes: its sends are out, its landings are in
      // place (a forward holds its own share of one it relays).
      for (size_t i = begin; i < end; ++i) {
        all[i].staging = std::make_shared<StagingBuffer>();
        all[i].sum.reset();
      }
      begin = end;
    }
    if (options.checksums)
      if (Status s = holders_hashes(); !s.ok()) return s;
    if (options.stats) *options.stats = stats;
    return Status();
  };
  try {
    return run();
  } catch (const std::bad_alloc&) {
    const Status s = unavailable("many-sender plan: rank " + std::to_string(rank) + " has no memory for its moves");
    if (!sums.empty()) return fail_sum(sums.front(), s);  // every posted Work settled (or its memory let go) first
    if (all.empty()) return s;
    return fail(all.front(), s);
  }
}

}  // namespace paramcast::reshard::detail
