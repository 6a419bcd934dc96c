// HostRun's receives: for each piece that comes, land, check, decode,
// place, relay; then the forwards against their holders' hashes.
#include <cstring>

#include "common/delta/delta_codec.h"
#include "common/reshard/executor_host.h"
#include "common/xxhash.h"

namespace paramcast::reshard::detail {

// A dense plan's receives are one batch: every receive posted at once, in
// schedule order, so each link carries its bytes back to back, with no
// barrier between rounds. A delta plan's go round by round: a round's
// pieces come from senders, which posted everything at once, or from
// forwards of earlier rounds, which every rank finished before: no rank
// waits on one that waits on it.
size_t HostRun::batch_end(size_t begin) const { return delta_ ? round_end(recvs_, begin) : recvs_.size(); }

// Posts the batch's receives: dense, each into its place (or staging) with
// its checksum; delta, the round's headers, then the receives they announce.
Status HostRun::post_batch(size_t begin, size_t end) {
  if (!delta_) {
    for (size_t i = begin; i < end; ++i) post_dense_receive(recvs_[i]);
    return Status();
  }
  for (size_t i = begin; i < end; ++i) {
    Posted& p = recvs_[i];
    p.head_work = comm.recv(p.head, sizeof(PieceHeader), transfer(p.transfer).from,
                            static_cast<uint32_t>(p.transfer) | kHeaderTag);
    ++stats.messages;
  }
  for (size_t i = begin; i < end; ++i)
    if (Status s = post_delta_receive(recvs_[i]); !s.ok()) return s;
  return Status();
}

void HostRun::post_dense_receive(Posted& p) {
  if (p.lead) {  // a bundle comes whole, at its first piece
    if (p.lead == &p) post_bundle_receive(p);
    return;
  }
  const Transfer& x = transfer(p.transfer);
  p.direct = p.in_place >= 0;
  uint8_t* into = p.direct ? p.at->data + p.in_place : nullptr;
  if (!p.direct) {
    p.stage().resize(x.bytes);
    into = p.staging->data();
  }
  p.work = comm.recv(into, x.bytes, x.from, static_cast<uint32_t>(p.transfer));
  p.bytes = into;
  p.wire = x.bytes;
  ++stats.messages;
  if (options.checksums && x.after < 0) {  // a forward is checked once every move landed
    p.sum_work = comm.recv(p.sum, sizeof(uint64_t), x.from, static_cast<uint32_t>(p.transfer) | kChecksumTag);
    ++stats.messages;
  }
}

// A bundle: one receive into its first piece's staging (tag: that piece's
// index), and with checksums the hash of it all; each piece's bytes are its
// part of that staging, unpacked at its own place (place).
void HostRun::post_bundle_receive(Posted& lead) {
  uint64_t total = 0;
  for (const Posted* m : lead.members) total += transfer(m->transfer).bytes;
  lead.stage().resize(total);
  uint64_t at = 0;
  for (Posted* m : lead.members) {
    m->staging = lead.staging;
    m->bytes = lead.staging->data() + at;
    m->wire = transfer(m->transfer).bytes;
    at += m->wire;
  }
  const Transfer& first = transfer(lead.transfer);
  const uint32_t tag = static_cast<uint32_t>(lead.transfer);
  lead.work = comm.recv(lead.staging->data(), total, first.from, tag);
  ++stats.messages;
  if (options.checksums && !lead.relayed) {
    lead.sum_work = comm.recv(lead.sum, sizeof(uint64_t), first.from, tag | kChecksumTag);
    ++stats.messages;
  }
}

// A delta plan's piece once its header came: the header checked, then its
// wire bytes posted (a dense piece into its place, an encoding into staging).
Status HostRun::post_delta_receive(Posted& p) {
  const Transfer& x = transfer(p.transfer);
  if (Status s = p.head_work->wait(deadline); !s.ok()) return fail(p.transfer, s);
  if (Status s = check_header(p); !s.ok()) return fail(p.transfer, s);
  const PieceHeader& h = *p.head;
  p.wire = h.wire_bytes;
  if (!p.wire) return Status();
  uint8_t* into = nullptr;
  if (h.kind == static_cast<uint8_t>(delta::Kind::kDense)) {
    p.direct = p.in_place >= 0;
    if (p.direct) into = p.at->data + p.in_place;
  }
  if (!into) {
    p.stage().resize(p.wire);
    into = p.staging->data();
  }
  p.bytes = into;
  p.work = comm.recv(into, p.wire, x.from, static_cast<uint32_t>(p.transfer));
  ++stats.messages;
  return Status();
}

// A piece's header, before a byte of it is taken: a known encoding, the
// element's unit, check_header's rules (a dense piece's unit free), and a
// delta smaller than the piece.
Status HostRun::check_header(const Posted& p) const {
  const Transfer& x = transfer(p.transfer);
  const PieceHeader& h = *p.head;
  const delta::Header dh{static_cast<delta::Kind>(h.kind), h.unit, h.changed, h.wire_bytes, {h.hash},
                         Checksum::kXxh64};
  const std::string what = "'" + name(x) + "' " + x.region.to_string() + " from rank " + std::to_string(x.from);
  if (h.kind > static_cast<uint8_t>(delta::Kind::kUnchanged))
    return data_corrupt("delta header of " + what + ": unknown encoding " + std::to_string(h.kind));
  if (h.kind != static_cast<uint8_t>(delta::Kind::kDense) && h.unit != element(x))
    return data_corrupt("delta header of " + what + ": unit " + std::to_string(h.unit) + ", the " +
                        std::string(dtype_name(plan.tensors[x.tensor].dtype)) + " element is " +
                        std::to_string(element(x)) + " bytes");
  if (h.kind == static_cast<uint8_t>(delta::Kind::kDense)) {
    if (h.wire_bytes != x.bytes)
      return data_corrupt("delta header of " + what + ": dense of " + std::to_string(h.wire_bytes) +
                          " wire bytes, expected " + std::to_string(x.bytes));
  } else if (Status s = delta::check_header(dh, x.bytes, 1, what); !s.ok()) {
    return s;
  } else if (h.kind != static_cast<uint8_t>(delta::Kind::kUnchanged) && h.wire_bytes >= x.bytes) {
    // An encoder sends a delta only when it is smaller than the piece.
    return data_corrupt("delta header of " + what + ": " + std::to_string(h.wire_bytes) +
                        " wire bytes for a piece of " + std::to_string(x.bytes));
  }
  return Status();
}

// One piece that comes: land, check, decode, place, relay. It counts once
// it landed (a dense plan's: once checked; a delta counts its encoding). A
// bundle lands and is checked whole at its first piece; each of its pieces
// is placed, counted and relayed at its own.
Status HostRun::receive(size_t piece) {
  Posted& p = recvs_[piece];
  for (const auto* w : {&p.work, &p.sum_work})
    if (*w)
      if (Status s = (*w)->wait(deadline); !s.ok()) return fail(p.transfer, s);
  if (delta_) count_received(p.wire);
  auto now = check_decode(p);
  if (!now.ok()) return fail(p.transfer, now.status());
  if (!delta_) count_received(p.wire);
  place(p, *now);
  relay(piece);
  if (p.lead && &p == p.lead->members.back())  // a bundle all placed: its staging goes
    for (Posted* m : p.lead->members) m->staging.reset();
  return Status();
}

// A landed piece's new bytes, contiguous, checked against the hash that
// came with them (a forward's, relayed: its holder's is checked at the end):
// as they came, or a delta applied onto the region as it is (the base),
// with every hostile-input check of common/delta/ before a byte is written.
StatusOr<const uint8_t*> HostRun::check_decode(Posted& p) {
  const Transfer& x = transfer(p.transfer);
  if (!delta_) {
    if (p.sum_work)
      if (Status s = p.members.empty() ? verify(p, p.bytes, *p.sum, "arrived") : verify_bundle(p); !s.ok())
        return s;
    return p.bytes;
  }
  const PieceHeader& h = *p.head;
  const auto kind = static_cast<delta::Kind>(h.kind);
  if (kind == delta::Kind::kDense) {
    if (Status s = verify(p, p.bytes, h.hash, "arrived"); !s.ok()) return s;
    return p.bytes;
  }
  // The region changed in place: straight in the buffer when contiguous,
  // else packed, changed, and unpacked by place().
  uint8_t* region = read(p, scratch_);
  if (kind != delta::Kind::kUnchanged) {
    const delta::Header dh{kind, h.unit, h.changed, h.wire_bytes, {h.hash}, Checksum::kXxh64};
    const std::string what = "'" + name(x) + "' " + x.region.to_string() + " from rank " + std::to_string(x.from);
    if (Status s = delta::apply(dh, p.bytes, x.bytes, {delta::Segment{nullptr, region, 0, x.bytes}}, what, indices_);
        !s.ok())
      return s;
  }
  if (Status s = verify(p, region, h.hash,
                        "after its delta onto v" + std::to_string(options.delta_base) +
                            " (this rank's bytes were not that version)");
      !s.ok())
    return s;
  return region;
}

// A piece's new bytes into the rank's buffer, unless they are there already
// (a region contiguous there lands, or is changed, in place; a bundle's
// piece lands in the bundle's staging).
void HostRun::place(const Posted& p, const uint8_t* bytes) const {
  const Transfer& x = transfer(p.transfer);
  if (p.in_place < 0)
    copy_region(bytes, x.region, p.at->data, p.at->box, x.region, element(x));
  else if (p.lead)  // a bundle's piece, from the bundle's staging to where it lies back to back
    std::memcpy(p.at->data + p.in_place, bytes, x.bytes);
}

// A received piece goes on to the ranks it is forwarded to: in a delta
// plan its header and wire bytes as they came (its receiver holds the same
// base), else from where it was placed; a bundle's pieces that all go on
// to one rank, as one relay once the last of them is placed.
void HostRun::relay(size_t piece) {
  Posted& p = recvs_[piece];
  if (p.lead && p.lead->relay && &p == p.lead->members.back()) send_relay(*p.lead);
  for (uint32_t k = schedule_->forward_begin[piece]; k < schedule_->forward_begin[piece + 1]; ++k) {
    Posted* f = &sends_[schedule_->forwarded[k]];
    if (f->lead) continue;  // in a relay
    if (delta_) {
      *f->head = *p.head;
      f->bytes = p.bytes;
      f->wire = p.wire;
      f->staging = p.staging;  // where those bytes are, unless in place: kept while the forward reads them
    } else {
      read_dense(*f);
    }
    post(*f);
  }
}

// A received bundle's bytes go on whole, as they came (its first piece's
// staging, kept while the relay reads it), tagged with the relay's first
// forward; each piece is checked at the end against its holder's hash.
void HostRun::send_relay(Posted& source) {
  Posted& r = *source.relay;
  r.staging = source.staging;
  r.bytes = r.staging->data();
  r.wire = r.staging->size();
  r.work = comm.send(r.bytes, r.wire, transfer(r.transfer).to, static_cast<uint32_t>(r.transfer));
  stats.wire_sent += r.wire;
  stats.dense += r.members.size();
  ++stats.messages;
}

// The forwards this rank received, as they are now in its buffers, against
// the hashes their holders sent (last on every pair; one message from each).
Status HostRun::check_forwards() {
  if (!checked_) return Status();
  if (Status s = take_holder_sums(); !s.ok()) return s;
  std::vector<uint8_t> packed;
  for (size_t j = 0; j < taken_.size(); ++j) {
    const HolderSums& h = taken_[j];
    const RankSchedule::PeerForwards& t = schedule_->taken[j];
    if (Status s = h.work->wait(deadline); !s.ok()) return fail(t.forwards.front(), s);
    for (size_t k = 0; k < t.at.size(); ++k) {
      const Posted& p = recvs_[t.at[k]];
      if (Status s = verify(p, read(p, packed), (*h.sums)[k], "landed"); !s.ok()) return fail(p.transfer, s);
    }
  }
  return Status();
}

// The holders' hashes of the forwards this rank received: one receive from
// each holder, the forwards in schedule order.
Status HostRun::take_holder_sums() {
  taken_.resize(schedule_->taken.size());
  for (size_t j = 0; j < taken_.size(); ++j) {
    const RankSchedule::PeerForwards& t = schedule_->taken[j];
    HolderSums& h = taken_[j];
    h.peer = t.peer;
    h.sums->resize(t.forwards.size());
    h.work = comm.recv(h.sums->data(), h.sums->size() * sizeof(uint64_t), h.peer,
                       static_cast<uint32_t>(t.forwards.front()) | kChecksumTag);
    ++stats.messages;
  }
  return Status();
}

// A piece's bytes against the hash that checks them (xxh64).
Status HostRun::verify(const Posted& p, const uint8_t* bytes, uint64_t want, const std::string& what) const {
  const uint64_t got = xxh64(bytes, transfer(p.transfer).bytes);
  if (got == want) return Status();
  return mismatch(p.transfer, what, "xxh64", got, want, "sent xxh64 ");
}

// A bundle's bytes, at its first piece, against the hash of them all (its
// sender's); the failure names the first piece.
Status HostRun::verify_bundle(const Posted& lead) const {
  const uint64_t got = xxh64(lead.staging->data(), lead.staging->size());
  if (got == *lead.sum) return Status();
  return data_corrupt("a bundle of " + std::to_string(lead.members.size()) + " pieces, " +
                      std::to_string(lead.staging->size()) + " bytes, arrived with xxh64 " + digest_hex(got) +
                      ", the sender's " + digest_hex(*lead.sum));
}

}  // namespace paramcast::reshard::detail
