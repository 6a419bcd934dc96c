// An update's outcomes on the publisher (publisher_impl.h): every member's
// Applied collected, shed and unconfirmed members, the links' rates, a
// reader that stalled, and the update abandoned when it failed.
#include <algorithm>

#include "common/control/messages.h"
#include "common/data/gloo/tree.h"  // who may shed whom: the Gloo plane's tree
#include "common/log.h"
#include "common/units.h"
#include "trainer_side/publisher_impl.h"
#include "trainer_side/slowest_link.h"

namespace paramcast {

// After the data plane finished, Applied is due within apply_timeout (the
// engines' on_update_end included), and within the cap. auto: recomputed at
// each report, as this update's own Applied times come in.
std::string PublisherImpl::wait_applied_locked(std::unique_lock<std::mutex>& lock, Clock::time_point start,
                                               const Waiting& waiting) {
  const Millis fixed = cfg_.publisher.apply_timeout;
  std::string why;
  for (;;) {
    const auto waited_for = waiting();
    Deadline until = cap_;
    if (fixed.count() > 0) {
      until = std::min(cap_, start + fixed);
      why = waited("apply_timeout", fixed, until);
    } else {
      const ApplyBound b = auto_apply_bound_locked(start, waited_for);
      until = std::min(cap_, start + b.bound);
      why = until >= cap_ ? waited("apply_timeout", b.bound, until) : "within apply_timeout (" + b.why + ")";
    }
    if (round_.applied(waited_for) || stopped_ || Clock::now() >= until) break;
    cv_.wait_until(lock, until);  // a report (or stop) wakes it; the bound is derived again
  }
  for (const auto& [id, at] : round_.applied_ok_times())
    apply_history_.record(id, std::max(Millis{0}, std::chrono::duration_cast<Millis>(at - start)));
  return why;
}

ApplyBound PublisherImpl::auto_apply_bound_locked(Clock::time_point start,
                                                  const UpdateRound::IsLive& waited_for) const {
  std::optional<ApplyMillis> own, peers;
  bool first = false;  // a silent member with no Applied on record: the ceiling for all
  for (const auto& id : round_.group())
    if (waited_for(id) && round_.silent_on_applied(id)) {
      const auto s = apply_history_.slowest(id);
      first |= !s;
      if (s && (!own || *s > *own)) own = s;
    }
  if (first) own.reset();
  for (const auto& [id, at] : round_.applied_ok_times()) {
    const auto took = std::max(Millis{0}, std::chrono::duration_cast<Millis>(at - start));
    if (!peers || took > *peers) peers = took;
  }
  return auto_apply_bound(own, peers);
}

// 5. Applied: waits for every member's report. After a data failure, waits
// at most one heartbeat timeout more so that the members that died are named:
// the verdict comes within timeout + one interval of their last heartbeat,
// and two more intervals cover a control thread slowed by a loaded machine.
void PublisherImpl::collect_applied(const UpdatePlan& plan, const Status& data, UpdateResult& r) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto live = [this](const std::string& id) { return is_live(id); };
  const auto extra = cfg_.control.heartbeat_timeout + 3 * cfg_.control.heartbeat_interval;
  // A shed member is not waited for: it reports when it learns it was shed.
  const bool shedding = cfg_.publisher.on_slow_member == SlowMemberPolicy::kShed;
  const Waiting waiting = [&] {  // live and not shed, at this moment
    auto shed = shedding ? shed_members() : std::set<std::string>();
    return UpdateRound::IsLive([this, shed](const std::string& id) { return is_live(id) && !shed.count(id); });
  };
  std::string deadline = "before update_timeout (" + format_duration(cfg_.publisher.update_timeout) + ")";
  if (data.ok()) {
    deadline = wait_applied_locked(lock, Clock::now(), waiting);
  } else {
    cv_.wait_until(lock, Clock::now() + extra, [&] { return round_.applied(waiting()) || stopped_; });
  }
  if (move_ended_ != Clock::time_point{}) {
    r.data_seconds = std::chrono::duration<double>(move_ended_ - move_started_).count();
    const auto [last, at] = round_.last_applied();
    if (!last.empty() && at > move_ended_) {
      r.apply_seconds = std::chrono::duration<double>(at - move_ended_).count();
      r.last_to_apply = last;
    }
  }
  Code code;
  r.subscribers = round_.applied_outcomes(live, silence(), data, code, deadline + " after the data plane finished");
  note_shapes_applied_locked(r);
  if (shedding) apply_shed(r, data, code);
  if (data.ok() && cfg_.publisher.on_member_loss == MemberLossPolicy::kContinue) apply_unconfirmed(r, code);
  const auto strike = apply_delta_refusals(plan, r, data, code);
  if (!strike.empty()) needs_reform_ = true;  // without them once quarantined
  set_link_rates(r);
  if (!r.shed.empty()) needs_reform_ = true;  // their communicators are gone: a new group next time
  if (code == Code::kOk) {
    published_version_ = r.version;
    server_.set_published_version(r.version);
    validated_ = ValidatedManifest{groups_.epoch(), plan.manifest_hash, plan.checksum, plan.partial};
    if (baseline_fresh_) baseline_.set_version(plan.version);
    round_.end();
    lock.unlock();
    strike_delta_refusers(strike);
    return;
  }
  needs_reform_ = true;
  abandon_locked(r.version, "update failed");
  round_.end();
  note_data_suspects_locked(r);
  // A reader this rank's own data plane saw alone take nothing for
  // stall_timeout (the shm root sees every reader's progress) is
  // quarantined at once: the next update forms without it instead of
  // stalling on it again.
  std::string stalled;
  if (const int rank = comm_ ? comm_->stalled_peer() : -1; rank > 0 && rank <= static_cast<int>(group_.size()))
    stalled = group_[static_cast<size_t>(rank - 1)];
  lock.unlock();
  strike_delta_refusers(strike);
  if (!stalled.empty())
    groups_.quarantine(stalled, "took no bytes from the publisher's shared memory for stall_timeout while the "
                                "other readers took theirs (seen by the publisher itself)");
  comm_.reset();
  std::string what = "update v";
  what += std::to_string(r.version);
  what += " failed";
  if (!data.ok()) what += " (publisher data plane: " + data.message() + ")";
  r.status = summarize_outcomes(r.subscribers, code, what);
}

// The members that applied a sharded plan hold its shape: the next plan of
// that shape goes to them by reference (send_plan_frames). Only in the
// incarnation the plan went to: a member restarted meanwhile holds none.
void PublisherImpl::note_shapes_applied_locked(const UpdateResult& r) {
  for (auto it = known_shapes_.begin(); it != known_shapes_.end();)  // bounded by the members live
    it = is_live(it->first) ? std::next(it) : known_shapes_.erase(it);
  if (sent_shape_.digest == 0) return;
  for (const auto& o : r.subscribers) {
    const auto m = server_.member(o.worker_id);
    const auto sent = sent_incarnation_.find(o.worker_id);
    if (o.status.ok() && m && sent != sent_incarnation_.end() && sent->second == m->incarnation)
      known_shapes_[o.worker_id] = {m->incarnation, sent_shape_};
  }
}

// The live members a failed update names (after its moves began) prove
// their data path before the next formation (probe_data_suspects).
void PublisherImpl::note_data_suspects_locked(const UpdateResult& r) {
  for (const auto& o : r.subscribers)
    if (!o.status.ok() && !o.shed && is_live(o.worker_id))
      data_suspects_[o.worker_id] = "in update v" + std::to_string(r.version) + ", which failed";
}

// Only the member's parent in the broadcast tree of the plane it receives
// on can shed it: the Gloo plane's ranks are the publisher and, in a mixed
// group, the members off its host (in rank order, the root first:
// split_communicator.h); a member on the shm plane is shed by nobody. A
// claim from any other member (hostile, or confused) is logged, naming its
// sender, and ignored.
std::function<int(int)> PublisherImpl::plane_parent() const {
  const auto& group = round_.group();  // group[i] is rank i + 1
  const int world = static_cast<int>(group.size()) + 1;
  const auto& local = groups_.local();
  auto plane = std::make_shared<std::vector<int>>();  // the Gloo plane's ranks, by their index there
  auto index = std::make_shared<std::map<int, int>>();  // group rank -> index on the Gloo plane
  for (int g = 0; g < world; ++g)
    if (g == 0 || local.empty() || static_cast<size_t>(g) >= local.size() || !local[static_cast<size_t>(g)]) {
      (*index)[g] = static_cast<int>(plane->size());
      plane->push_back(g);
    }
  return [plane, index](int g) {
    auto it = index->find(g);
    if (it == index->end()) return -2;  // on the shm plane: nobody's child
    const int p = gloo_backend::BinomialTree::of(it->second, static_cast<int>(plane->size()), 0).parent;
    return p < 0 ? -1 : (*plane)[static_cast<size_t>(p)];
  };
}

std::set<std::string> PublisherImpl::shed_members() {
  std::set<std::string> out;
  const auto& group = round_.group();  // group[i] is rank i + 1
  const auto parent_of = plane_parent();
  auto name = [&](int rank) { return rank == 0 ? std::string("publisher") : group[static_cast<size_t>(rank) - 1]; };
  auto credible = [&](int parent, int child) {
    if (child < 1 || static_cast<size_t>(child) > group.size()) return false;
    if (parent_of(child) == parent) return true;
    std::string line = "'";
    line += control::printable(name(parent));
    line += "' reported on the link to '";
    line += name(child);
    line += "', whose parent it is not; ignored";
    server_.log_peer("forged claim", line);
    return false;
  };
  auto add = [&](const LinkStats& l) {
    if (l.shed) out.insert(group[static_cast<size_t>(l.peer) - 1]);
  };
  for (const auto& l : own_links_)
    if (credible(0, l.peer)) add(l);
  for (const auto& [rank, l] : round_.reported_links(credible)) add(l.link);
  return out;
}

void PublisherImpl::apply_unconfirmed(UpdateResult& r, Code& code) {
  bool applied_any = false;
  for (const auto& o : r.subscribers) applied_any = applied_any || o.status.ok();
  if (!applied_any) return;
  for (auto& o : r.subscribers) {
    if (o.status.ok() || o.shed || !is_live(o.worker_id) || !round_.silent_on_applied(o.worker_id)) continue;
    o.unconfirmed = true;
    o.status = timeout_error(o.status.message() + "; it is dirty (unconfirmed), and the update stands for the "
                                                  "members that applied it (on_member_loss: continue)");
    r.unconfirmed.push_back(o.worker_id);
  }
  if (!r.unconfirmed.empty()) {
    code = others_code(r.subscribers);
    needs_reform_ = true;  // its communicator may be mid-update: a new group next time
  }
}

void PublisherImpl::apply_shed(UpdateResult& r, const Status& data, Code& code) {
  const auto shed = shed_members();
  if (shed.empty()) return;
  for (auto& o : r.subscribers) {
    if (!shed.count(o.worker_id) || o.status.ok()) continue;  // shed on its last chunk, and applied: not shed
    o.shed = true;
    std::string what = "subscriber '";
    what += o.worker_id;
    what += "' was shed from update v";
    what += std::to_string(r.version);
    o.status = timeout_error(what + ": its inbound link ran below publisher.slow_member_floor (" +
                             format_rate(cfg_.publisher.slow_member_floor) +
                             "); it is dirty until the next update (on_slow_member: shed)");
    r.shed.push_back(o.worker_id);
  }
  if (!data.ok()) return;
  code = others_code(r.subscribers);
}

// Each member's inbound link rate, from its parent's figures (the
// publisher's own links, and what members reported forwarding), where the
// update was slow (slowest_link.h), and the link rates `paramcast status`
// shows. Called with mu_ held.
void PublisherImpl::set_link_rates(UpdateResult& r) {
  const auto parent_of = plane_parent();
  auto links = round_.reported_links([&](int parent, int child) { return parent_of(child) == parent; });
  for (const auto& l : own_links_) links[l.peer] = UpdateRound::InboundLink{0, l};
  const auto& group = round_.group();  // group[i] is rank i + 1
  std::map<int, const SubscriberOutcome*> by_rank;
  std::map<int, InboundRate> rates;
  for (auto& o : r.subscribers) {
    const auto at = std::find(group.begin(), group.end(), o.worker_id);
    if (at == group.end()) continue;
    const int rank = static_cast<int>(at - group.begin()) + 1;
    by_rank[rank] = &o;
    if (const auto l = links.find(rank); l != links.end()) {
      o.link_rate = l->second.link.send_rate();
      rates[rank] = InboundRate{l->second.parent, o.link_rate};
    }
    if (o.link_rate > 0) {
      server_.set_member_link_rate(o.worker_id, r.version, static_cast<uint64_t>(o.link_rate));
      link_rate_[o.worker_id] = o.link_rate;
    }
  }
  const int named = slowest_link(rates);
  if (named == 0) {
    r.slowest = "publisher";  // every link out of the publisher was about as slow: its own uplink
  } else if (named > 0 && by_rank.count(named)) {
    r.slowest = by_rank[named]->worker_id;
  } else if (named < 0) {  // no link figures (NCCL, shm): the slowest receive rate
    const SubscriberOutcome* slowest = nullptr;
    for (const auto& [rank, o] : by_rank)
      if (o->rate() > 0 && (!slowest || o->rate() < slowest->rate())) slowest = o;
    if (slowest) r.slowest = slowest->worker_id;
  }
}

std::string PublisherImpl::slowest_receiver(uint64_t version) const {
  std::string who;
  uint64_t least = 0;
  for (const auto& id : server_.live_ids()) {
    auto m = server_.member(id);
    if (!m || m->receiving_version != version) continue;
    if (who.empty() || m->received_bytes < least) {
      who = id;
      least = m->received_bytes;
    }
  }
  return who.empty() ? "" : "; slowest member: '" + who + "' (" + format_bytes(least) + " received)";
}

// Tells every live member of the round that has not applied `version` to give it up.
void PublisherImpl::abandon_locked(uint64_t version, const std::string& reason) {
  for (const auto& id : round_.group()) {
    if (!is_live(id) || round_.applied_ok(id)) continue;
    server_.send(id, control::make_message(groups_.epoch(), server_.incarnation(), [&](auto b) {
                   auto m = b.initAbandon();
                   m.setVersion(version);
                   m.setReason(reason);
                 }));
  }
}

}  // namespace paramcast
