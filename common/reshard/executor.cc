#include "common/reshard/executor.h"

#include "common/delta/delta_codec.h"
#include "common/xxhash.h"

#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <optional>

namespace paramcast::reshard {

void copy_region(const uint8_t* src, const Region& from, uint8_t* dst, const Region& to, const Region& region,
                 size_t element) {
  for_each_run(from, to, region, element,
               [&](uint64_t f, uint64_t t, size_t bytes) { std::memcpy(dst + t, src + f, bytes); });
}

namespace {

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

}  // namespace

StatusOr<LocalBuffer> detail::buffer_of(const ReshardPlan& plan, const RankBuffers& buffers, const Transfer& x,
                                        int rank) {
  LocalBuffer at = buffers.find(plan.tensors[x.tensor], x.region);
  if (!at.data || intersect(at.box, x.region) != x.region)
    return internal_error("many-sender plan: rank " + std::to_string(rank) + " has no buffer for '" +
                          plan.tensors[x.tensor].name + "' " + x.region.to_string());
  return at;
}

Status run_reshard(const ReshardPlan& plan, const std::vector<Round>& rounds, int rank, Communicator& comm,
                   const RankBuffers& buffers, Deadline deadline, const RunOptions& options) {
  if (plan.transfers.size() >= kHeaderTag)
    return invalid_argument("many-sender plan: " + std::to_string(plan.transfers.size()) +
                            " transfers, more than a tag can number");
  if (options.memory) return detail::run_reshard_by_rounds(plan, rounds, rank, comm, buffers, deadline, options);
  const bool delta = options.delta_base != 0;
  if (options.sent) options.sent->begin_run();
  RunOptions::Stats stats;
  struct Posted {
    size_t transfer = 0;
    size_t round = 0;
    std::shared_ptr<Work> work;
    std::shared_ptr<Work> sum_work;   // the checksum that follows it (dense plans with checksums)
    std::shared_ptr<Work> head_work;  // its header (delta plans)
    std::shared_ptr<uint64_t> sum = std::make_shared<uint64_t>(0);  // sent, or received
    std::shared_ptr<PieceHeader> head = std::make_shared<PieceHeader>();
    const uint8_t* bytes = nullptr;  // the bytes on the wire, contiguous (a receive: once landed)
    uint64_t wire = 0;               // how many
    // Packed bytes (a send) or their landing (a receive) when not contiguous;
    // shared with the sends that relay them (a forward, a repeat).
    std::shared_ptr<std::vector<uint8_t>> staging = std::make_shared<std::vector<uint8_t>>();
    std::shared_ptr<std::vector<uint8_t>> encoded;  // a send's delta encoding (shared by sends of the same piece)
    LocalBuffer at;                  // this rank's buffer the region is in
    bool direct = false;
  };
  // This rank's transfers, in schedule order.
  std::vector<Posted> sends, recvs;
  for (size_t k = 0; k < rounds.size(); ++k)
    for (size_t i : rounds[k].transfers) {
      const Transfer& x = plan.transfers[i];
      if (x.from != rank && x.to != rank) continue;
      Posted p;
      p.transfer = i;
      p.round = k;
      auto at = detail::buffer_of(plan, buffers, x, rank);
      if (!at.ok()) {
        if (options.sent) options.sent->end_run(false);
        return at.status();
      }
      p.at = *at;
      (x.from == rank ? sends : recvs).push_back(std::move(p));
    }
  std::vector<Posted*> all;
  for (auto& p : sends) all.push_back(&p);
  for (auto& p : recvs) all.push_back(&p);
  auto element = [&](const Transfer& x) { return dtype_size(plan.tensors[x.tensor].dtype); };
  auto name = [&](const Transfer& x) -> const std::string& { return plan.tensors[x.tensor].name; };
  // Checked pieces (dense with checksums; every piece of a delta plan): the
  // hash a receiver checks comes from the rank that holds the piece, also
  // for a forward (chain_start): a rank that forwards a piece relays its
  // bytes, never its hash, so it cannot change them unseen. This rank sends
  // the hash of each piece it holds to every rank its chain reaches.
  const bool checked = delta || options.checksums;
  auto holder = [&](size_t i) { return plan.transfers[chain_start(plan, i)].from; };
  // The hashes this rank sends as a holder, in schedule order, once all its
  // own sends are posted; each rank takes them after all its moves landed,
  // in the same order, and checks the forwards it received then. Last on
  // both ends of every pair, they never hold up a move of the plan (the shm
  // plane serves receives in the order they were posted; a holder waits for
  // its oldest sends before it packs more).
  struct HolderSum {
    size_t transfer = 0;  // the forward it checks
    std::shared_ptr<uint64_t> sum = std::make_shared<uint64_t>(0);
    std::shared_ptr<Work> work;
  };
  std::vector<HolderSum> holder_sums;
  if (checked)
    for (size_t k = 0; k < rounds.size(); ++k)
      for (size_t i : rounds[k].transfers)
        if (plan.transfers[i].after >= 0 && plan.transfers[i].to != rank && holder(i) == rank)
          holder_sums.push_back(HolderSum{i, std::make_shared<uint64_t>(0), nullptr});
  std::map<size_t, uint64_t> hash_of;  // a transfer this rank sent as holder -> its piece's hash
  auto post_holder_sums = [&] {
    for (HolderSum& h : holder_sums) {
      auto it = hash_of.find(chain_start(plan, h.transfer));
      *h.sum = it == hash_of.end() ? 0 : it->second;  // always sent earlier (a forward follows its piece)
      h.work = comm.send(h.sum.get(), sizeof(uint64_t), plan.transfers[h.transfer].to,
                         static_cast<uint32_t>(h.transfer) | kChecksumTag);
    }
  };
  // The region's bytes in the rank's buffer, contiguous: in place, or packed into `staging`.
  auto piece_of = [&](Posted& p) -> uint8_t* {
    const Transfer& x = plan.transfers[p.transfer];
    if (const auto at = contiguous_at(p.at.box, x.region, element(x))) return p.at.data + *at;
    p.staging->resize(x.bytes);
    copy_region(p.at.data, p.at.box, p.staging->data(), x.region, x.region, element(x));
    return p.staging->data();
  };
  // The sender's baseline of a piece it sends: its bytes as this version.
  auto record = [&](const Transfer& x, const uint8_t* now) {
    if (!options.sent) return;
    SentBaseline::Piece& b = options.sent->piece(name(x), x.region);
    try {
      b.bytes.assign(now, now + x.bytes);
      b.version = options.version;
    } catch (const std::bad_alloc&) {
      b.bytes = {};
      b.version = 0;
      b.used = false;  // dropped at the run's end; this piece goes dense next time
    }
  };
  // A delta plan's pieces encoded by this run, by tensor and region: a
  // piece sent twice is encoded once (the baseline moved with the first).
  std::map<std::pair<uint32_t, Region>, Posted*> encoded;
  std::vector<uint8_t> mask;
  auto encode = [&](Posted& p) {
    const Transfer& x = plan.transfers[p.transfer];
    if (auto it = encoded.find({x.tensor, x.region}); it != encoded.end()) {
      *p.head = *it->second->head;
      p.bytes = it->second->bytes;
      p.wire = it->second->wire;
      p.encoded = it->second->encoded;
      p.staging = it->second->staging;  // its bytes may be there
      return;
    }
    encoded[{x.tensor, x.region}] = &p;
    const uint8_t* now = piece_of(p);
    SentBaseline::Piece* base = options.sent ? &options.sent->piece(name(x), x.region) : nullptr;
    p.bytes = now;
    p.wire = x.bytes;
    p.head->kind = static_cast<uint8_t>(delta::Kind::kDense);
    p.head->unit = static_cast<uint32_t>(element(x));
    if (!base || base->version != options.delta_base || base->bytes.size() != x.bytes) {
      p.head->wire_bytes = x.bytes;
      p.head->hash = xxh64(now, x.bytes);
      record(x, now);
      ++stats.dense;
      return;
    }
    std::vector<uint8_t> out(x.bytes);
    const delta::Header h = delta::encode({delta::Segment{now, base->bytes.data(), 0, x.bytes}}, x.bytes,
                                          p.head->unit, options.delta_always, out.data(), mask);
    base->version = options.version;  // the encoding moved it to these bytes
    p.head->kind = static_cast<uint8_t>(h.kind);
    p.head->changed = h.changed;
    p.head->wire_bytes = h.wire_bytes;
    p.head->hash = h.piece_hashes.at(0);
    p.wire = h.wire_bytes;
    if (h.kind == delta::Kind::kDense) {
      ++stats.dense;  // worth no delta: straight from the piece
    } else if (h.kind == delta::Kind::kUnchanged) {
      ++stats.unchanged;
    } else {
      ++stats.delta;
      p.encoded = std::make_shared<std::vector<uint8_t>>(out.begin(), out.begin() + static_cast<long>(h.wire_bytes));
      p.bytes = p.encoded->data();
    }
  };
  auto post_send = [&](Posted& p) {
    const Transfer& x = plan.transfers[p.transfer];
    const uint32_t tag = static_cast<uint32_t>(p.transfer);
    if (delta) {
      p.head_work = comm.send(p.head.get(), sizeof(PieceHeader), x.to, tag | kHeaderTag);
      if (p.wire) p.work = comm.send(p.bytes, p.wire, x.to, tag);
      stats.wire_sent += p.wire;
      if (x.after < 0) hash_of[p.transfer] = p.head->hash;
      return;
    }
    const uint8_t* from = piece_of(p);
    if (x.after < 0) record(x, from);
    ++stats.dense;
    p.work = comm.send(from, x.bytes, x.to, tag);
    stats.wire_sent += x.bytes;
    if (options.checksums && x.after < 0) {  // a forward's hash comes from the piece's holder
      *p.sum = xxh64(from, x.bytes);
      p.sum_work = comm.send(p.sum.get(), sizeof(uint64_t), x.to, tag | kChecksumTag);
      hash_of[p.transfer] = *p.sum;
    }
  };
  // A failure: abort, and let every posted Work settle (an aborted
  // communicator completes them once no I/O is left on them) before the
  // staging goes; staging whose Work does not settle is let go, never
  // freed under a write.
  auto settle_all = [&](const Status& s) {
    comm.abort(s.message());
    for (Posted* q : all) {
      if (q->work) {
        Status settled = q->work->wait(Clock::now() + kSettleTimeout);
        if (settled.code() == Code::kTimeout || !q->work->settled()) {
          if (q->direct && options.unsettled) *options.unsettled = true;
          new std::shared_ptr<std::vector<uint8_t>>(q->staging);              // deliberately leaked
          new std::shared_ptr<std::vector<uint8_t>>(std::move(q->encoded));  // deliberately leaked
        }
      }
      for (const auto* w : {&q->sum_work, &q->head_work})
        if (*w && ((*w)->wait(Clock::now() + kSettleTimeout).code() == Code::kTimeout || !(*w)->settled())) {
          new std::shared_ptr<uint64_t>(q->sum);          // deliberately leaked
          new std::shared_ptr<PieceHeader>(q->head);  // deliberately leaked
        }
    }
    for (auto& h : holder_sums)
      if (h.work && (h.work->wait(Clock::now() + kSettleTimeout).code() == Code::kTimeout || !h.work->settled()))
        new std::shared_ptr<uint64_t>(h.sum);  // deliberately leaked
    if (options.sent) options.sent->end_run(false);
  };
  auto fail = [&](const Posted& p, Status s) {
    settle_all(s);
    const Transfer& x = plan.transfers[p.transfer];
    return s.with_context("many-sender plan: '" + name(x) + "' " + x.region.to_string() + " from rank " +
                          std::to_string(x.from) + " to rank " + std::to_string(x.to));
  };

  // A received piece that landed (and, in a delta plan, was applied): its
  // bytes checked against the hash that came with them.
  auto verify = [&](Posted& p, const uint8_t* bytes, uint64_t want, const char* what) -> Status {
    const Transfer& x = plan.transfers[p.transfer];
    const uint64_t got = xxh64(bytes, x.bytes);
    if (got == want) return Status();
    if (x.after < 0)
      return data_corrupt(std::to_string(x.bytes) + " bytes " + what + " with xxh64 " + digest_hex(got) +
                          ", the sender's " + digest_hex(want));
    return data_corrupt(std::to_string(x.bytes) + " bytes " + what + " with xxh64 " + digest_hex(got) +
                        " as rank " + std::to_string(x.from) + " forwarded them; rank " +
                        std::to_string(holder(p.transfer)) + ", which holds them, sent xxh64 " + digest_hex(want));
  };
  // Staging, encodings and scratch are allocated as the transfers go; a
  // machine out of memory fails the run (every posted Work settled first),
  // it does not end the process.
  auto run = [&]() -> Status {
    std::map<size_t, std::vector<Posted*>> forwards;  // by the transfer that brings their bytes
    // A rank that only sends keeps its packed pieces and encodings within
    // staging_limit: before it packs or encodes the next piece, the oldest
    // sends holding any are waited for and let go. Its sends go in schedule
    // order and its receivers take them round by round, so the oldest always
    // completes.
    std::deque<Posted*> holding;
    uint64_t held = 0;
    auto held_by = [](const Posted& q) {
      return static_cast<uint64_t>(q.staging->size()) + (q.encoded ? q.encoded->size() : 0);
    };
    // A delta plan's piece sent again later reuses this send's encoding:
    // it is kept until its last send is posted.
    std::map<std::pair<uint32_t, Region>, int> sends_left;
    for (const auto& p : sends)
      if (plan.transfers[p.transfer].after < 0)
        ++sends_left[{plan.transfers[p.transfer].tensor, plan.transfers[p.transfer].region}];
    auto make_room = [&](const Posted& next, uint64_t need) -> Status {
      while (options.staging_limit && recvs.empty() && !holding.empty() && held + need > options.staging_limit) {
        Posted* q = holding.front();
        const Transfer& qx = plan.transfers[q->transfer];
        if (delta && sends_left[{qx.tensor, qx.region}] > 0) break;  // its encoding is still to be sent again
        holding.pop_front();
        for (const auto* w : {&q->head_work, &q->work, &q->sum_work})
          if (*w)
            if (Status s = (*w)->wait(deadline); !s.ok()) return fail(*q, s);
        held -= held_by(*q);
        q->staging = std::make_shared<std::vector<uint8_t>>();  // sent: its bytes are free (a repeat holds its own)
        q->encoded.reset();
      }
      (void)next;
      return Status();
    };
    for (auto& p : sends) {
      const Transfer& x = plan.transfers[p.transfer];
      if (x.after >= 0) {
        forwards[static_cast<size_t>(x.after)].push_back(&p);
        continue;
      }
      const bool packs = !contiguous_at(p.at.box, x.region, element(x)).has_value();
      if (Status s = make_room(p, delta || packs ? x.bytes : 0); !s.ok()) return s;
      if (delta) encode(p);
      post_send(p);
      --sends_left[{x.tensor, x.region}];
      if (const uint64_t h = held_by(p); h > 0) {
        held += h;
        holding.push_back(&p);
      }
    }
    post_holder_sums();
    // A received piece goes on to the ranks it is forwarded to: in a delta
    // plan its header and wire bytes as they came, else from where it landed.
    auto forward = [&](Posted& p) {
      for (Posted* f : forwards[p.transfer]) {
        if (delta) {
          *f->head = *p.head;
          f->bytes = p.bytes;
          f->wire = p.wire;
          f->staging = p.staging;  // where those bytes are, unless in place: kept while the forward reads them
        }
        post_send(*f);
      }
    };
    if (!delta) {
      // Every receive is posted at once, in schedule order, into its place
      // (or staging): each link then carries its bytes back to back, with no
      // barrier between rounds. A forward goes out once the receive that
      // brings its bytes landed.
      for (auto& p : recvs) {
        const Transfer& x = plan.transfers[p.transfer];
        const auto at = contiguous_at(p.at.box, x.region, element(x));
        p.direct = at.has_value();
        uint8_t* into = at ? p.at.data + *at : nullptr;
        if (!at) {
          p.staging->resize(x.bytes);
          into = p.staging->data();
        }
        p.work = comm.recv(into, x.bytes, x.from, static_cast<uint32_t>(p.transfer));
        p.bytes = into;
        if (options.checksums && x.after < 0)  // a forward is checked once every move landed
          p.sum_work = comm.recv(p.sum.get(), sizeof(uint64_t), x.from, static_cast<uint32_t>(p.transfer) | kChecksumTag);
      }
      for (auto& p : recvs) {
        const Transfer& x = plan.transfers[p.transfer];
        if (Status s = p.work->wait(deadline); !s.ok()) return fail(p, s);
        if (p.sum_work) {
          if (Status s = p.sum_work->wait(deadline); !s.ok()) return fail(p, s);
          if (Status s = verify(p, p.bytes, *p.sum, "arrived"); !s.ok()) return fail(p, s);
        }
        stats.wire_received += x.bytes;
        if (options.received) *options.received += x.bytes;
        if (!p.direct) copy_region(p.staging->data(), x.region, p.at.data, p.at.box, x.region, element(x));
        forward(p);
      }
    } else {
      // Round by round: the round's headers, then the receives they announce
      // (a dense piece into its place, an encoding into staging), then each
      // applied, checked and forwarded. A round's pieces come from senders,
      // which posted everything at once, or from forwards of earlier rounds,
      // which every rank finished before: no rank waits on one that waits
      // on it.
      std::vector<uint8_t> scratch, indices;
      for (size_t begin = 0; begin < recvs.size();) {
        size_t end = begin;
        while (end < recvs.size() && recvs[end].round == recvs[begin].round) ++end;
        for (size_t i = begin; i < end; ++i) {
          Posted& p = recvs[i];
          const Transfer& x = plan.transfers[p.transfer];
          p.head_work = comm.recv(p.head.get(), sizeof(PieceHeader), x.from, static_cast<uint32_t>(p.transfer) | kHeaderTag);
        }
        for (size_t i = begin; i < end; ++i) {
          Posted& p = recvs[i];
          const Transfer& x = plan.transfers[p.transfer];
          if (Status s = p.head_work->wait(deadline); !s.ok()) return fail(p, s);
          const PieceHeader& h = *p.head;
          const delta::Header dh{static_cast<delta::Kind>(h.kind), h.unit, h.changed, h.wire_bytes, {h.hash},
                                 Checksum::kXxh64};
          const std::string what = "'" + name(x) + "' " + x.region.to_string() + " from rank " + std::to_string(x.from);
          if (h.kind > static_cast<uint8_t>(delta::Kind::kUnchanged))
            return fail(p, data_corrupt("delta header of " + what + ": unknown encoding " + std::to_string(h.kind)));
          if (h.kind != static_cast<uint8_t>(delta::Kind::kDense) && h.unit != element(x))
            return fail(p, data_corrupt("delta header of " + what + ": unit " + std::to_string(h.unit) + ", the " +
                                        std::string(dtype_name(plan.tensors[x.tensor].dtype)) + " element is " +
                                        std::to_string(element(x)) + " bytes"));
          if (h.kind == static_cast<uint8_t>(delta::Kind::kDense)) {
            // check_header's rules, with the unit of a dense piece free.
            if (h.wire_bytes != x.bytes)
              return fail(p, data_corrupt("delta header of " + what + ": dense of " + std::to_string(h.wire_bytes) +
                                          " wire bytes, expected " + std::to_string(x.bytes)));
          } else if (Status s = delta::check_header(dh, x.bytes, 1, what); !s.ok()) {
            return fail(p, s);
          } else if (h.kind != static_cast<uint8_t>(delta::Kind::kUnchanged) && h.wire_bytes >= x.bytes) {
            // An encoder sends a delta only when it is smaller than the piece.
            return fail(p, data_corrupt("delta header of " + what + ": " + std::to_string(h.wire_bytes) +
                                        " wire bytes for a piece of " + std::to_string(x.bytes)));
          }
          p.wire = h.wire_bytes;
          if (!p.wire) continue;
          uint8_t* into = nullptr;
          if (h.kind == static_cast<uint8_t>(delta::Kind::kDense)) {
            const auto at = contiguous_at(p.at.box, x.region, element(x));
            p.direct = at.has_value();
            if (at) into = p.at.data + *at;
          }
          if (!into) {
            p.staging->resize(p.wire);
            into = p.staging->data();
          }
          p.bytes = into;
          p.work = comm.recv(into, p.wire, x.from, static_cast<uint32_t>(p.transfer));
        }
        for (size_t i = begin; i < end; ++i) {
          Posted& p = recvs[i];
          const Transfer& x = plan.transfers[p.transfer];
          const PieceHeader& h = *p.head;
          if (p.work)
            if (Status s = p.work->wait(deadline); !s.ok()) return fail(p, s);
          const uint64_t hash = h.hash;  // a forward's, relayed: its holder's is checked at the end
          stats.wire_received += p.wire;
          if (options.received) *options.received += p.wire;
          const auto kind = static_cast<delta::Kind>(h.kind);
          const auto at = contiguous_at(p.at.box, x.region, element(x));
          if (kind == delta::Kind::kDense) {
            if (Status s = verify(p, p.bytes, hash, "arrived"); !s.ok()) return fail(p, s);
            if (!p.direct) copy_region(p.bytes, x.region, p.at.data, p.at.box, x.region, element(x));
          } else {
            // The region as it is (the base), changed in place: straight in
            // the buffer when contiguous, else packed, changed and unpacked.
            uint8_t* region = at ? p.at.data + *at : nullptr;
            if (!region) {
              scratch.resize(x.bytes);
              copy_region(p.at.data, p.at.box, scratch.data(), x.region, x.region, element(x));
              region = scratch.data();
            }
            if (kind != delta::Kind::kUnchanged) {
              const delta::Header dh{kind, h.unit, h.changed, h.wire_bytes, {h.hash}, Checksum::kXxh64};
              const std::string what = "'" + name(x) + "' " + x.region.to_string() + " from rank " + std::to_string(x.from);
              if (Status s = delta::apply(dh, p.bytes, x.bytes, {delta::Segment{nullptr, region, 0, x.bytes}}, what, indices);
                  !s.ok())
                return fail(p, s);
            }
            if (Status s = verify(p, region, hash,
                                  ("after its delta onto v" + std::to_string(options.delta_base) +
                                   " (this rank's bytes were not that version)").c_str());
                !s.ok())
              return fail(p, s);
            if (!at) copy_region(region, x.region, p.at.data, p.at.box, x.region, element(x));
          }
          forward(p);
        }
        begin = end;
      }
    }
    // The forwards this rank received, as they are now in its buffers,
    // against the hashes their holders sent (last on every pair).
    if (checked) {
      for (auto& p : recvs)
        if (plan.transfers[p.transfer].after >= 0)
          p.sum_work = comm.recv(p.sum.get(), sizeof(uint64_t), holder(p.transfer),
                                 static_cast<uint32_t>(p.transfer) | kChecksumTag);
      std::vector<uint8_t> packed;
      for (auto& p : recvs) {
        const Transfer& x = plan.transfers[p.transfer];
        if (x.after < 0) continue;
        if (Status s = p.sum_work->wait(deadline); !s.ok()) return fail(p, s);
        const uint8_t* bytes = nullptr;
        if (const auto at = contiguous_at(p.at.box, x.region, element(x))) {
          bytes = p.at.data + *at;
        } else {
          packed.resize(x.bytes);
          copy_region(p.at.data, p.at.box, packed.data(), x.region, x.region, element(x));
          bytes = packed.data();
        }
        if (Status s = verify(p, bytes, *p.sum, "landed"); !s.ok()) return fail(p, s);
      }
    }
    for (auto& p : sends) {
      if (!p.work && !p.head_work) return fail(p, internal_error("a forward whose bytes never came"));
      for (const auto* w : {&p.head_work, &p.work, &p.sum_work})
        if (*w)
          if (Status s = (*w)->wait(deadline); !s.ok()) return fail(p, s);
    }
    for (auto& h : holder_sums)
      if (Status s = h.work->wait(deadline); !s.ok()) {
        settle_all(s);
        return s.with_context("many-sender plan: rank " + std::to_string(rank) +
                              " sending the hash of a piece it holds to a rank it is forwarded to");
      }
    if (options.sent) options.sent->end_run(true);
    if (options.stats) *options.stats = stats;
    return Status();
  };
  try {
    return run();
  } catch (const std::bad_alloc&) {
    const Status s = unavailable("many-sender plan: rank " + std::to_string(rank) +
                                        " has no memory for its staging or encodings");
    settle_all(s);
    return s;
  }
}

StatusOr<uint64_t> holding_digest(const void* data, uint64_t bytes, const Device& device, DeviceMemory* memory) {
  if (!device.is_cuda()) return xxh64(data, static_cast<size_t>(bytes));
  if (!memory) return internal_error("the digest of a region on " + device.to_string() + " needs that device's memory");
  return memory->checksum(data, static_cast<size_t>(bytes), Checksum::kXxh64Blocks);
}

}  // namespace paramcast::reshard
