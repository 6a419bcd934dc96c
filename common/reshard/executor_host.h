// HostRun: run_reshard's steps over host memory (executor.h says what the
// path does): executor.cc chooses and accounts, executor_send.cc sends the
// pieces this rank holds, executor_receive.cc receives and relays.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/reshard/executor_steps.h"

namespace paramcast::reshard::detail {

// A transfer's header in a delta plan (tag: its index | kHeaderTag).
struct PieceHeader {
  uint8_t kind = 0;  // delta::Kind
  uint8_t reserved[3] = {0, 0, 0};
  uint32_t unit = 0;
  uint64_t changed = 0;
  uint64_t wire_bytes = 0;
  uint64_t hash = 0;  // xxh64 of the piece's new bytes
};
static_assert(sizeof(PieceHeader) == 32, "PieceHeader is a wire format");

// One of this rank's transfers on the host path, as it goes.
struct Posted : Chosen {
  std::shared_ptr<Work> work;
  std::shared_ptr<Work> sum_work;   // the checksum that follows it (dense plans with checksums)
  std::shared_ptr<Work> head_work;  // its header (delta plans)
  // Sent, or received: both in the run's slab of small parts (choose;
  // HostRun::parts_, which a Work that does not settle keeps: settle).
  uint64_t* sum = nullptr;
  PieceHeader* head = nullptr;
  const uint8_t* bytes = nullptr;  // the bytes on the wire, contiguous (a receive: once landed)
  uint64_t wire = 0;               // how many
  // Packed bytes (a send) or their landing (a receive) when not contiguous;
  // shared with the sends that relay them (a forward, a repeat). Null until
  // a piece needs it (stage): most pieces land in place or in a bundle's.
  std::shared_ptr<std::vector<uint8_t>> staging;
  std::vector<uint8_t>& stage() {
    if (!staging) staging = std::make_shared<std::vector<uint8_t>>();
    return *staging;
  }
  std::shared_ptr<std::vector<uint8_t>> encoded;  // a send's delta encoding (shared by sends of the same piece)
  bool direct = false;                            // a receive straight into the rank's buffer
  // The region's byte offset in its buffer where it lies back to back there
  // (contiguous_at: it moves in place), else -1 (packed or unpacked).
  int64_t in_place = -1;
  // A bundle's piece (plan_bundles): the bundle's first piece carries its
  // moves, staging and checksum; each piece's bytes are its part of that
  // staging. Null: the piece travels alone.
  Posted* lead = nullptr;
  std::vector<Posted*> members;  // the first piece's: the bundle's pieces, in order
  // A relay's first piece: its bytes come as the forwarder received them,
  // checked piece by piece against the holders' hashes (no hash of its own).
  bool relayed = false;
  // A received bundle's first piece, where its pieces all go on to one rank:
  // the first piece of the relay that forwards them, sent once they are all placed.
  Posted* relay = nullptr;
};

// A piece's small parts, one slab a run: a Work that does not settle keeps
// the whole slab (settle), not one allocation per piece.
struct SmallParts {
  uint64_t sum = 0;
  PieceHeader head;
};

// The hashes of the pieces this rank holds whose chains reach one rank
// (`peer`), or that a rank takes from one holder (`peer`): one message a
// pair, tag: the first forward's index | kChecksumTag; both ends list the
// same forwards, in schedule order (RankSchedule's `sums` and `taken`).
struct HolderSums {
  int peer = -1;
  std::shared_ptr<std::vector<uint64_t>> sums = std::make_shared<std::vector<uint64_t>>();
  std::shared_ptr<Work> work;
};

// HostRun's schedule of a plan: all choose() derives from the plan and
// rounds alone (no buffer, no byte), kept for the next run of the same
// plan (RunOptions::schedule).
struct RankSchedule {
  const ReshardPlan* plan = nullptr;
  size_t transfers = 0;
  int rank = -1;
  bool delta = false, checked = false;
  std::vector<Chosen> sends, recvs;  // no buffer yet; receives in the order taken (relays gathered)
  std::vector<Bundle> bundles;       // dense plans (plan_bundles)
  // Forwards whose holders' hashes travel between this rank and one other
  // (`peer`), one message a pair: the forwards in schedule order, each with
  // the place of a piece in this rank's lists (`at`).
  struct PeerForwards {
    int peer = -1;
    std::vector<size_t> forwards;
    std::vector<uint32_t> at;
  };
  // Checked: the hashes this rank sends as the holder of pieces whose chains
  // reach other ranks, by receiver (ascending); `at`: the held piece's place
  // in `sends`.
  std::vector<PeerForwards> sums;
  std::vector<bool> chained;  // by place in `sends`: a piece this rank holds whose chain goes on
  // Each bundle's pieces, bundle after bundle, as places in this rank's
  // list of sends then receives (bundle()).
  std::vector<uint32_t> bundled;
  // The forwards each receive brings the bytes of: receive k's are the sends
  // at forwarded[forward_begin[k] .. forward_begin[k + 1]), in schedule order.
  std::vector<uint32_t> forward_begin, forwarded;
  // Checked: the forwards this rank receives, by their holder (ascending);
  // `at`: the forward's place in `recvs` (check_forwards).
  std::vector<PeerForwards> taken;
  // Each send's and receive's buffer as an index gave them (find_buffers),
  // kept while runs of this schedule come with that very index (the same
  // shards, or the same registrations): no lookup a piece.
  struct Found {
    std::shared_ptr<const BufferIndex> index;
    std::vector<const LocalBuffer*> sends, recvs;
    std::vector<int64_t> sends_in_place, recvs_in_place;  // each piece's Posted::in_place
  };
  mutable std::mutex found_mu;
  mutable std::shared_ptr<const Found> found;
};

class HostRun final : public RankRun {
 public:
  using RankRun::RankRun;

 private:
  using PieceKey = std::pair<uint32_t, Region>;  // a tensor's region
  PieceKey key(const Posted& p) const { return {transfer(p.transfer).tensor, transfer(p.transfer).region}; }

  // choose, account, and what sends and receives both use (executor.cc).
  Status choose() override;
  Status account() override;
  void settle(const Status& s) override;
  Status out_of_memory() override;
  Status wait_moves(const Posted& p);
  std::shared_ptr<const RankSchedule> schedule() const;
  std::shared_ptr<RankSchedule> derive_schedule() const;
  void gather_relays(RankSchedule& s) const;
  void place_pieces(RankSchedule& s) const;
  StatusOr<std::shared_ptr<const RankSchedule::Found>> find_buffers() const;
  void bundle(const RankSchedule& s);
  uint8_t* read(const Posted& p, std::vector<uint8_t>& into) const;
  uint8_t* read_staged(Posted& p) const;  // read, packing into the piece's own staging

  // For each piece this rank holds (executor_send.cc): make room in the
  // staging window, read (or pack) it, encode it, hash it, post it.
  Status send_held() override;
  Status make_room(uint64_t need);
  void read_dense(Posted& p);
  Status send_bundle(Posted& lead);
  void encode(Posted& p);
  void record(const Transfer& x, const uint8_t* now);
  void post(Posted& p);
  void post_holder_sums();

  // For each piece that comes (executor_receive.cc): land, check, decode,
  // place, relay; then the forwards against their holders' hashes.
  size_t batched() const override { return recvs_.size(); }
  size_t batch_end(size_t begin) const override;
  Status post_batch(size_t begin, size_t end) override;
  void post_dense_receive(Posted& p);
  void post_bundle_receive(Posted& lead);
  Status post_delta_receive(Posted& p);
  Status check_header(const Posted& p) const;
  Status receive(size_t piece) override;
  StatusOr<const uint8_t*> check_decode(Posted& p);
  void place(const Posted& p, const uint8_t* bytes) const;
  void relay(size_t piece);
  void send_relay(Posted& source);
  Status end_batch(size_t, size_t) override { return Status(); }
  Status check_forwards() override;
  Status take_holder_sums();
  Status verify(const Posted& p, const uint8_t* bytes, uint64_t want, const std::string& what) const;
  Status verify_bundle(const Posted& lead) const;

  const bool delta_ = options.delta_base != 0;
  // Checked pieces (dense with checksums; every piece of a delta plan): the
  // hash a receiver checks comes from the rank that holds the piece, also
  // for a forward (chain_start): a rank that forwards a piece relays its
  // bytes, never its hash, so it cannot change them unseen.
  const bool checked_ = delta_ || options.checksums;
  std::shared_ptr<const RankSchedule> schedule_;  // this run's (its bundles and order)
  // This rank's transfers, in schedule order; neither grows after choose(),
  // so pointers into them stay.
  std::vector<Posted> sends_, recvs_;
  std::vector<Posted*> all_;
  std::shared_ptr<std::vector<SmallParts>> parts_;  // every piece's sum and head
  // The hashes this rank sends as a holder, in schedule order, once all its
  // own sends are posted; each rank takes them after all its moves landed,
  // in the same order, and checks the forwards it received then. Last on
  // both ends of every pair, they never hold up a move of the plan (the shm
  // plane serves receives in the order they were posted; a holder waits for
  // its oldest sends before it packs more).
  std::vector<HolderSums> holder_sums_;  // sent, one per the schedule's `sums`
  std::vector<uint64_t> held_sums_;      // checked: the hash of each piece this rank holds, by place in sends_
  std::vector<HolderSums> taken_;        // taken, one per the schedule's `taken` (check_forwards)
  // A delta plan's pieces encoded by this run: a piece sent twice is
  // encoded once (the baseline moved with the first), and its encoding is
  // kept until its last send is posted.
  std::map<PieceKey, Posted*> encoded_;
  std::map<PieceKey, int> sends_left_;
  // The staging window of a rank that only sends: the sends holding packed
  // bytes or encodings, oldest first, and how many bytes they hold.
  std::deque<Posted*> holding_;
  uint64_t held_ = 0;
  std::vector<uint8_t> mask_, scratch_, indices_;
};

}  // namespace paramcast::reshard::detail
