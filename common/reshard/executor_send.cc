// HostRun's sends: for each piece this rank holds, read (or pack) it,
// encode it against the baseline, hash it, post it; then the hashes of the
// pieces its chains forward.
#include <cstring>

#include "common/delta/delta_codec.h"
#include "common/reshard/executor_host.h"
#include "common/xxhash.h"

namespace paramcast::reshard::detail {

namespace {

uint64_t held_by(const Posted& q) {
  return static_cast<uint64_t>(q.staging ? q.staging->size() : 0) + (q.encoded ? q.encoded->size() : 0);
}

}  // namespace

// Every piece this rank holds goes out at once, in schedule order (a
// forward waits for the receive that brings its bytes: relay); a rank that
// only sends holds at most staging_limit of packed pieces and encodings.
Status HostRun::send_held() {
  if (delta_)  // a piece sent twice keeps its encoding until its last send
    for (const auto& p : sends_)
      if (transfer(p.transfer).after < 0) ++sends_left_[key(p)];
  for (auto& p : sends_) {
    const Transfer& x = transfer(p.transfer);
    if (x.after >= 0) continue;  // goes once its bytes came (relay)
    if (p.lead) {  // a bundle goes out whole at its first piece
      if (p.lead == &p)
        if (Status s = send_bundle(p); !s.ok()) return s;
      continue;
    }
    const bool packs = p.in_place < 0;
    if (Status s = make_room(delta_ || packs ? x.bytes : 0); !s.ok()) return s;
    if (delta_)
      encode(p);  // read (or pack), encode against the baseline, hash
    else
      read_dense(p);  // read (or pack)
    post(p);          // post (dense: then its hash)
    if (delta_) --sends_left_[key(p)];
    if (const uint64_t h = held_by(p); h > 0) {
      held_ += h;
      holding_.push_back(&p);
    }
  }
  post_holder_sums();
  return Status();
}

// A rank that only sends keeps its packed pieces and encodings within
// staging_limit: before it packs or encodes the next piece (`need` bytes),
// the oldest sends holding any are waited for and let go. Its sends go in
// schedule order and its receivers take them round by round, so the oldest
// always completes. A delta plan's piece sent again later keeps its
// encoding until its last send is posted.
Status HostRun::make_room(uint64_t need) {
  while (options.staging_limit && recvs_.empty() && !holding_.empty() && held_ + need > options.staging_limit) {
    Posted* q = holding_.front();
    if (delta_ && sends_left_[key(*q)] > 0) break;  // its encoding is still to be sent again
    holding_.pop_front();
    if (Status s = wait_moves(*q); !s.ok()) return s;
    held_ -= held_by(*q);
    q->staging.reset();  // sent: its bytes are free (a repeat holds its own)
    q->encoded.reset();
  }
  return Status();
}

// A dense piece: its bytes in place or packed, recorded as the sender's
// baseline when this rank holds it.
void HostRun::read_dense(Posted& p) {
  const Transfer& x = transfer(p.transfer);
  p.bytes = read_staged(p);
  p.wire = x.bytes;
  if (x.after < 0) record(x, p.bytes);
  ++stats.dense;
}

// A bundle: its pieces packed back to back into its first piece's staging
// (within the staging window; each recorded as the sender's baseline), one
// send (tag: the first piece's index) and, with checksums, the hash of the
// packed bytes; a piece whose chain goes on keeps its own hash for the
// ranks the chain reaches.
Status HostRun::send_bundle(Posted& lead) {
  uint64_t total = 0;
  for (const Posted* m : lead.members) total += transfer(m->transfer).bytes;
  if (Status s = make_room(total); !s.ok()) return s;
  lead.stage().resize(total);
  uint64_t at = 0;
  for (Posted* m : lead.members) {
    const Transfer& x = transfer(m->transfer);
    uint8_t* into = lead.staging->data() + at;
    if (m->in_place >= 0)  // back to back in its buffer: one copy
      std::memcpy(into, m->at->data + m->in_place, x.bytes);
    else
      copy_region(m->at->data, m->at->box, into, x.region, x.region, element(x));
    m->bytes = into;
    m->wire = x.bytes;
    at += x.bytes;
    record(x, m->bytes);
    ++stats.dense;
    if (const size_t at = static_cast<size_t>(m - sends_.data()); options.checksums && schedule_->chained[at])
      held_sums_[at] = xxh64(m->bytes, x.bytes);  // for the ranks its chain reaches
  }
  const Transfer& first = transfer(lead.transfer);
  const uint32_t tag = static_cast<uint32_t>(lead.transfer);
  lead.work = comm.send(lead.staging->data(), total, first.to, tag);
  stats.wire_sent += total;
  ++stats.messages;
  if (options.checksums) {
    *lead.sum = xxh64(lead.staging->data(), total);
    lead.sum_work = comm.send(lead.sum, sizeof(uint64_t), first.to, tag | kChecksumTag);
    ++stats.messages;
  }
  held_ += total;
  holding_.push_back(&lead);
  return Status();
}

// The sender's baseline of a piece it sends: its bytes as this version.
void HostRun::record(const Transfer& x, const uint8_t* now) {
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
}

// A delta plan's piece: its header (encoding, wire bytes, the hash of its
// new bytes) and wire bytes, a delta against the baseline where this rank
// sent that very piece as the base version, else dense. A piece sent twice
// is encoded once (the baseline moved with the first).
void HostRun::encode(Posted& p) {
  const Transfer& x = transfer(p.transfer);
  if (auto it = encoded_.find(key(p)); it != encoded_.end()) {
    *p.head = *it->second->head;
    p.bytes = it->second->bytes;
    p.wire = it->second->wire;
    p.encoded = it->second->encoded;
    p.staging = it->second->staging;  // its bytes may be there
    return;
  }
  encoded_[key(p)] = &p;
  const uint8_t* now = read_staged(p);
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
                                        p.head->unit, options.delta_always, out.data(), mask_);
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
}

// A piece out (tag: its index): a delta plan's header, then its wire bytes
// (none when unchanged); a dense plan's bytes, then, with checksums, their
// hash. A piece this rank holds keeps its hash for the ranks its chain
// reaches (a forward's hash comes from the piece's holder).
void HostRun::post(Posted& p) {
  const Transfer& x = transfer(p.transfer);
  const uint32_t tag = static_cast<uint32_t>(p.transfer);
  if (delta_) p.head_work = comm.send(p.head, sizeof(PieceHeader), x.to, tag | kHeaderTag);
  if (!delta_ || p.wire) p.work = comm.send(p.bytes, p.wire, x.to, tag);
  stats.messages += (p.head_work ? 1 : 0) + (p.work ? 1 : 0);
  stats.wire_sent += p.wire;
  if (x.after >= 0) return;
  const size_t at = static_cast<size_t>(&p - sends_.data());
  if (delta_) {
    held_sums_[at] = p.head->hash;
  } else if (options.checksums) {
    *p.sum = xxh64(p.bytes, x.bytes);
    p.sum_work = comm.send(p.sum, sizeof(uint64_t), x.to, tag | kChecksumTag);
    ++stats.messages;
    held_sums_[at] = *p.sum;
  }
}

// The hashes of the pieces this rank holds, to every rank their chains
// reach, after all its own sends: one message to each (tag: its first
// forward's index | kChecksumTag), the hashes in schedule order.
void HostRun::post_holder_sums() {
  holder_sums_.resize(schedule_->sums.size());
  for (size_t j = 0; j < holder_sums_.size(); ++j) {
    const RankSchedule::PeerForwards& g = schedule_->sums[j];
    HolderSums& h = holder_sums_[j];
    h.peer = g.peer;
    h.sums->reserve(g.at.size());
    for (uint32_t at : g.at) h.sums->push_back(held_sums_[at]);  // always sent earlier (a forward follows its piece)
    h.work = comm.send(h.sums->data(), h.sums->size() * sizeof(uint64_t), h.peer,
                       static_cast<uint32_t>(g.forwards.front()) | kChecksumTag);
    ++stats.messages;
  }
}

}  // namespace paramcast::reshard::detail
