// run_reshard: the host path's entry (HostRun, executor_host.h), its
// choose and account steps, and what both executors use.
#include "common/reshard/executor.h"

#include "common/reshard/executor_host.h"
#include "common/xxhash.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

namespace paramcast::reshard {

void copy_region(const uint8_t* src, const Region& from, uint8_t* dst, const Region& to, const Region& region,
                 size_t element) {
  if (region.empty()) return;
  if (const auto f = contiguous_at(from, region, element))  // back to back at both ends: one copy
    if (const auto t = contiguous_at(to, region, element)) {
      std::memcpy(dst + *t, src + *f, region.elements() * element);
      return;
    }
  for_each_run(from, to, region, element,
               [&](uint64_t f, uint64_t t, size_t bytes) { std::memcpy(dst + t, src + f, bytes); });
}

void BufferIndex::add(size_t tensor, uint8_t* data, const Region& box) {
  if (tensor >= first_.size()) return;  // not the plan's: found by no transfer
  if (!first_[tensor].data) first_[tensor] = {data, box};
  else more_.emplace(tensor, LocalBuffer{data, box});
}

const LocalBuffer* BufferIndex::locate(size_t tensor, const Region& region) const {
  if (tensor >= first_.size()) return nullptr;
  if (first_[tensor].data && contains(first_[tensor].box, region)) return &first_[tensor];
  if (more_.empty()) return nullptr;
  const auto [begin, end] = more_.equal_range(tensor);
  for (auto it = begin; it != end; ++it)
    if (contains(it->second.box, region)) return &it->second;
  return nullptr;
}

StatusOr<const LocalBuffer*> detail::buffer_of(const ReshardPlan& plan, const RankBuffers& buffers, const Transfer& x,
                                               int rank, std::deque<LocalBuffer>& found) {
  const LocalBuffer* at = nullptr;
  if (buffers.index) {
    at = buffers.index->locate(x.tensor, x.region);
  } else if (buffers.find) {
    if (LocalBuffer b = buffers.find(x.tensor, plan.tensors[x.tensor], x.region); b.data)
      at = &found.emplace_back(std::move(b));
  }
  if (!at || !at->data || !contains(at->box, x.region))
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
  return detail::HostRun(plan, rounds, rank, comm, buffers, deadline, options).run();
}

StatusOr<uint64_t> holding_digest(const void* data, uint64_t bytes, const Device& device, DeviceMemory* memory) {
  if (!device.is_cuda()) return xxh64(data, static_cast<size_t>(bytes));
  if (!memory) return internal_error("the digest of a region on " + device.to_string() + " needs that device's memory");
  return memory->checksum(data, static_cast<size_t>(bytes), Checksum::kXxh64Blocks);
}

namespace detail {

// This rank's transfers split into its sends and its receives, each with
// its buffer, and the forwards whose holder's hash it sends, from its
// schedule of the plan; the baseline's run begins (a failure here ends it:
// the next run goes dense).
Status HostRun::choose() {
  if (options.sent) options.sent->begin_run();
  schedule_ = schedule();
  auto found = find_buffers();
  if (!found.ok()) {
    if (options.sent) options.sent->end_run(false);
    return found.status();
  }
  for (auto [chosen, at, in_place, into] :
       {std::tuple{&schedule_->sends, &(*found)->sends, &(*found)->sends_in_place, &sends_},
        std::tuple{&schedule_->recvs, &(*found)->recvs, &(*found)->recvs_in_place, &recvs_}}) {
    into->resize(chosen->size());
    for (size_t k = 0; k < chosen->size(); ++k) {
      static_cast<Chosen&>((*into)[k]) = (*chosen)[k];
      (*into)[k].at = (*at)[k];
      (*into)[k].in_place = (*in_place)[k];
    }
  }
  parts_ = std::make_shared<std::vector<SmallParts>>(sends_.size() + recvs_.size());
  size_t k = 0;
  all_.reserve(parts_->size());
  for (auto* list : {&sends_, &recvs_})
    for (Posted& p : *list) {
      SmallParts& mine = (*parts_)[k++];
      p.sum = &mine.sum;
      p.head = &mine.head;
      all_.push_back(&p);
    }
  if (checked_) held_sums_.assign(sends_.size(), 0);
  bundle(*schedule_);
  return Status();
}

// Each send's and receive's buffer: as the schedule kept them for the
// run's index, or found piece by piece (and kept, where the run has an index).
StatusOr<std::shared_ptr<const RankSchedule::Found>> HostRun::find_buffers() const {
  if (buffers.index) {
    std::lock_guard<std::mutex> lock(schedule_->found_mu);
    if (schedule_->found && schedule_->found->index == buffers.index) return schedule_->found;
  }
  auto found = std::make_shared<RankSchedule::Found>();
  found->index = buffers.index;
  for (auto [chosen, into, in_place] : {std::tuple{&schedule_->sends, &found->sends, &found->sends_in_place},
                                        std::tuple{&schedule_->recvs, &found->recvs, &found->recvs_in_place}}) {
    into->reserve(chosen->size());
    in_place->reserve(chosen->size());
    for (const Chosen& c : *chosen) {
      const Transfer& x = transfer(c.transfer);
      auto at = buffer_of(plan, buffers, x, rank, found_);
      if (!at.ok()) return at.status();
      into->push_back(*at);
      const auto offset = contiguous_at((*at)->box, x.region, element(x));
      in_place->push_back(offset ? static_cast<int64_t>(*offset) : -1);
    }
  }
  if (buffers.index) {
    std::lock_guard<std::mutex> lock(schedule_->found_mu);
    schedule_->found = found;
  }
  return std::shared_ptr<const RankSchedule::Found>(std::move(found));
}

// The schedule kept for this plan (RunOptions::schedule), or a new one.
std::shared_ptr<const RankSchedule> HostRun::schedule() const {
  if (options.schedule && *options.schedule) {
    const RankSchedule& kept = **options.schedule;
    if (kept.plan == &plan && kept.transfers == plan.transfers.size() && kept.rank == rank &&
        kept.delta == delta_ && kept.checked == checked_)
      return *options.schedule;
  }
  std::shared_ptr<const RankSchedule> s = derive_schedule();
  if (options.schedule) *options.schedule = s;
  return s;
}

// Walks the plan: this rank's transfers in schedule order, the forwards
// whose holder's hash it sends, a dense plan's bundles and relays.
std::shared_ptr<RankSchedule> HostRun::derive_schedule() const {
  auto s = std::make_shared<RankSchedule>();
  s->plan = &plan;
  s->transfers = plan.transfers.size();
  s->rank = rank;
  s->delta = delta_;
  s->checked = checked_;
  for (size_t k = 0; k < rounds.size(); ++k)
    for (size_t i : rounds[k].transfers) {
      const Transfer& x = plan.transfers[i];
      if (x.from == rank || x.to == rank) (x.from == rank ? s->sends : s->recvs).push_back(Chosen{i, k, {}});
    }
  if (!delta_) {
    s->bundles = plan_bundles(plan, rounds, rank);
    gather_relays(*s);
  }
  place_pieces(*s);
  return s;
}

// Where the pieces of the bundles, of the forwards and of the holders'
// hashes stand in this rank's lists (sends then receives), found once a
// schedule.
void HostRun::place_pieces(RankSchedule& s) const {
  std::unordered_map<size_t, uint32_t> place;  // a transfer -> its place
  place.reserve(s.sends.size() + s.recvs.size());
  for (const auto* list : {&s.sends, &s.recvs})
    for (const Chosen& c : *list) place.emplace(c.transfer, static_cast<uint32_t>(place.size()));
  for (const Bundle& b : s.bundles)
    for (size_t i : b.transfers) s.bundled.push_back(place.at(i));
  // A forward whose bytes this rank never receives is never sent (account names it).
  auto brought_by = [&](const Chosen& f) -> long {
    const long after = transfer(f.transfer).after;
    const auto it = after < 0 ? place.end() : place.find(static_cast<size_t>(after));
    return it == place.end() || it->second < s.sends.size() ? -1 : static_cast<long>(it->second - s.sends.size());
  };
  s.forward_begin.assign(s.recvs.size() + 1, 0);
  for (const Chosen& f : s.sends)
    if (const long k = brought_by(f); k >= 0) ++s.forward_begin[static_cast<size_t>(k) + 1];
  for (size_t k = 0; k < s.recvs.size(); ++k) s.forward_begin[k + 1] += s.forward_begin[k];
  s.forwarded.resize(s.forward_begin.back());
  std::vector<uint32_t> next(s.forward_begin.begin(), s.forward_begin.end() - 1);
  for (uint32_t j = 0; j < s.sends.size(); ++j)
    if (const long k = brought_by(s.sends[j]); k >= 0) s.forwarded[next[static_cast<size_t>(k)]++] = j;
  if (!checked_) return;
  s.chained.assign(s.sends.size(), false);
  std::map<int, RankSchedule::PeerForwards> sent, taken;  // by peer, ascending
  auto add = [](std::map<int, RankSchedule::PeerForwards>& to, int peer, size_t forward, uint32_t at) {
    RankSchedule::PeerForwards& g = to[peer];
    g.peer = peer;
    g.forwards.push_back(forward);
    g.at.push_back(at);
  };
  for (size_t i : hashed_forwards(/*sends=*/true, /*takes=*/false)) {
    const uint32_t held = place.at(chain_start(plan, i));  // a piece this rank holds: one of its sends
    add(sent, transfer(i).to, i, held);
    s.chained[held] = true;
  }
  for (uint32_t k = 0; k < s.recvs.size(); ++k)
    if (const size_t i = s.recvs[k].transfer; transfer(i).after >= 0) add(taken, holder(i), i, k);
  for (auto& [peer, g] : sent) s.sums.push_back(std::move(g));
  for (auto& [peer, g] : taken) s.taken.push_back(std::move(g));
}

// A relay this rank receives comes whole once every forward in it can have
// come: its pieces are taken together, in the relay's order, at the place
// of the last of them in the schedule (where its forwarder has received
// them all), so no rank waits for a relay before what its forwarder waits for.
void HostRun::gather_relays(RankSchedule& s) const {
  std::unordered_map<size_t, size_t> place;  // a receive's transfer -> its index in s.recvs
  for (size_t k = 0; k < s.recvs.size(); ++k) place[s.recvs[k].transfer] = k;
  std::unordered_map<size_t, const Bundle*> last;  // a relay's last piece here -> the relay
  std::unordered_set<size_t> gathered;
  for (const Bundle& b : s.bundles) {
    if (!b.relay || transfer(b.transfers.front()).to != rank) continue;
    size_t end = 0;
    for (size_t i : b.transfers) end = std::max(end, place.at(i));
    gathered.insert(b.transfers.begin(), b.transfers.end());
    last[s.recvs[end].transfer] = &b;
  }
  if (last.empty()) return;
  std::vector<Chosen> order;
  order.reserve(s.recvs.size());
  for (const Chosen& c : s.recvs) {
    if (const auto it = last.find(c.transfer); it != last.end())
      for (size_t i : it->second->transfers) order.push_back(s.recvs[place.at(i)]);
    else if (!gathered.count(c.transfer))
      order.push_back(c);
  }
  s.recvs = std::move(order);
}

// A dense plan's small pieces between the same pair of ranks, as bundles
// (plan_bundles): each piece points to its bundle's first, which lists
// them; a received bundle whose pieces all go on to one rank points to the
// relay that takes them.
void HostRun::bundle(const RankSchedule& s) {
  std::vector<Posted*> leads;
  leads.reserve(s.bundles.size());
  size_t k = 0;
  for (const Bundle& b : s.bundles) {
    Posted* lead = leads.emplace_back(all_[s.bundled[k]]);
    lead->relayed = b.relay;
    lead->members.reserve(b.transfers.size());
    for (size_t n = 0; n < b.transfers.size(); ++n) {
      Posted* p = all_[s.bundled[k++]];
      p->lead = lead;
      lead->members.push_back(p);
    }
    if (b.source >= 0 && transfer(lead->transfer).from == rank) leads[static_cast<size_t>(b.source)]->relay = lead;
  }
}

// A piece's moves (header, bytes, checksum), waited for in that order.
Status HostRun::wait_moves(const Posted& p) {
  for (const auto* w : {&p.head_work, &p.work, &p.sum_work})
    if (*w)
      if (Status s = (*w)->wait(deadline); !s.ok()) return fail(p.transfer, s);
  return Status();
}

// Every send out (a forward that never went names its piece), then the
// holders' hashes; the baseline kept, the stats handed over.
Status HostRun::account() {
  for (auto& p : sends_) {
    if (!p.work && !p.head_work && (!p.lead || p.lead == &p))  // a bundle's piece went with its first
      return fail(p.transfer, internal_error("a forward whose bytes never came"));
    if (Status s = wait_moves(p); !s.ok()) return s;
  }
  for (auto& h : holder_sums_)
    if (Status s = h.work->wait(deadline); !s.ok()) {
      settle(s);
      return s.with_context("many-sender plan: rank " + std::to_string(rank) +
                            " sending the hash of a piece it holds to a rank it is forwarded to");
    }
  if (options.sent) options.sent->end_run(true);
  report_stats();
  return Status();
}

// A failure: abort, and let every posted Work settle (an aborted
// communicator completes them once no I/O is left on them) before the
// staging goes; staging whose Work does not settle is let go, never freed
// under a write.
void HostRun::settle(const Status& s) {
  comm.abort(s.message());
  bool parts_unsettled = false;
  for (Posted* q : all_) {
    if (unsettled(q->work)) {
      if (q->direct && options.unsettled) *options.unsettled = true;
      new std::shared_ptr<std::vector<uint8_t>>(q->staging);              // deliberately leaked
      new std::shared_ptr<std::vector<uint8_t>>(std::move(q->encoded));  // deliberately leaked
    }
    parts_unsettled = parts_unsettled || unsettled(q->sum_work) || unsettled(q->head_work);
  }
  if (parts_unsettled) new std::shared_ptr<std::vector<SmallParts>>(parts_);  // deliberately leaked
  for (auto* sums : {&holder_sums_, &taken_})
    for (auto& h : *sums)
      if (unsettled(h.work)) new std::shared_ptr<std::vector<uint64_t>>(h.sums);  // deliberately leaked
  if (options.sent) options.sent->end_run(false);
}

// Staging, encodings and scratch are allocated as the transfers go; a
// machine out of memory fails the run (every posted Work settled first).
Status HostRun::out_of_memory() {
  const Status s = unavailable("many-sender plan: rank " + std::to_string(rank) +
                               " has no memory for its staging or encodings");
  settle(s);
  return s;
}

// The region's bytes in the rank's buffer, contiguous: in place, or packed into `into`.
uint8_t* HostRun::read(const Posted& p, std::vector<uint8_t>& into) const {
  const Transfer& x = transfer(p.transfer);
  if (p.in_place >= 0) return p.at->data + p.in_place;
  into.resize(x.bytes);
  copy_region(p.at->data, p.at->box, into.data(), x.region, x.region, element(x));
  return into.data();
}

uint8_t* HostRun::read_staged(Posted& p) const {
  if (p.in_place >= 0) return p.at->data + p.in_place;
  return read(p, p.stage());
}

}  // namespace detail
}  // namespace paramcast::reshard
