// The publisher's group: start() (the expected members, then the first
// formation), who is wanted in a group (quarantine, common/group/group_host.h),
// and forming it again when membership changed, within the update's deadline.
#include <algorithm>
#include <map>

#include "common/log.h"
#include "trainer_side/publisher_impl.h"

namespace paramcast {

// ------------------------------------------------------------------ start()
Status PublisherImpl::start() {
  std::lock_guard<UpdateGate> ulock(update_mu_);
  const auto deadline = Clock::now() + cfg_.control.join_timeout;
  std::vector<std::string> missing;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [&] { return server_.missing().empty() || stopped_; });
    missing = server_.missing();
  }
  if (!missing.empty()) {
    const std::string what = "join_timeout (" + std::to_string(cfg_.control.join_timeout.count()) +
                             "ms) passed with subscribers missing: " + join_ids(missing);
    if (cfg_.publisher.on_missing_at_start == MissingAtStartPolicy::kFail || server_.live_ids().empty())
      return timeout_error(what);
    PC_WARN("publisher: " << what << "; starting with those present (they are admitted when they join)");
  }
  Status formed = form_group(Deadline::max());
  // on_missing_at_start: start_with_present also covers members that are
  // present but break formation: each one the failure names is quarantined
  // (and named), and the others start. Never on the evidence against all.
  for (int attempt = 0; !formed.ok() && attempt < 3 && !stopped_ &&
                        cfg_.publisher.on_missing_at_start == MissingAtStartPolicy::kStartWithPresent;
       ++attempt) {
    const auto blamed = groups_.last_blamed();
    const auto live = server_.live_ids();
    if (blamed.empty() || blamed.size() >= live.size()) break;
    const auto excluded = groups_.excluded();  // those named on conclusive evidence are already out
    for (const auto& id : blamed)
      if (!excluded.count(id)) groups_.quarantine(id, "broke the start-up group formation: " + formed.message());
    PC_WARN("publisher: starting without " << join_ids(blamed) << " (they broke the start-up group formation: "
                                           << formed.message() << ")");
    formed = form_group(Deadline::max());
  }
  return formed;
}

// The live members not in quarantine; every live member when all of them
// are (quarantine never leaves the group empty on its own). In rank order:
// by worker id, except that members whose inbound link ran below half the
// median rate in the last update that measured it come last: the highest ranks are leaves
// of Gloo's broadcast tree, so a slow link holds back no subtree.
std::vector<std::string> PublisherImpl::wanted_members(std::map<std::string, std::string>* excluded) const {
  *excluded = groups_.excluded();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, why] : left_out_for_wants_locked()) excluded->emplace(id, why);
  }
  std::vector<std::string> members;
  const auto live = server_.live_ids();
  for (const auto& id : live)
    if (!excluded->count(id)) members.push_back(id);
  if (members.empty() && !live.empty()) {
    excluded->clear();
    members = live;
  }
  std::map<std::string, double> rate;
  std::vector<double> known;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& id : members)
      if (auto it = link_rate_.find(id); it != link_rate_.end()) {
        rate[id] = it->second;
        known.push_back(it->second);
      }
  }
  if (known.size() >= 2) {
    std::nth_element(known.begin(), known.begin() + static_cast<std::ptrdiff_t>(known.size() / 2), known.end());
    const double median = known[known.size() / 2];
    std::stable_partition(members.begin(), members.end(),
                          [&](const std::string& id) { return !rate.count(id) || rate[id] * 2 >= median; });
  }
  return members;
}

Status PublisherImpl::form_group(Deadline cap, int retries, const std::vector<std::string>* only) {
  comm_.reset();
  {
    std::lock_guard<std::mutex> lock(mu_);
    needs_reform_ = false;
  }
  auto live = server_.live();
  std::map<std::string, std::string> excluded;
  std::vector<std::string> members = only ? *only : wanted_members(&excluded);
  {
    std::lock_guard<std::mutex> lock(mu_);
    group_ = members;
    departed_.clear();  // the new group is formed of those live now
    formed_generation_ = live.generation;  // what on_member_event need not act on again
    const auto ids = server_.live_ids();   // figures of members gone are dropped: bounded
    for (auto it = link_rate_.begin(); it != link_rate_.end();)
      it = std::find(ids.begin(), ids.end(), it->first) == ids.end() ? link_rate_.erase(it) : std::next(it);
  }
  for (const auto& [id, why] : excluded)
    PC_WARN("publisher: forming the group without '" << id << "' (" << why << ")");
  auto comm = groups_.form(members, cap);
  // Members named on conclusive evidence are in quarantine now, and members
  // that left or were lost meanwhile are gone: the others form again at
  // once, within the same deadline, so that one broken or departing member
  // costs this update the time of one formation, not the update. A member
  // that joined meanwhile is not added: it waits for the next formation.
  if (!comm.ok() && retries > 0 && !stopped_) {
    std::vector<std::string> dropped = groups_.last_conclusive();
    for (const auto& id : members)
      if (groups_.gone(id) && std::find(dropped.begin(), dropped.end(), id) == dropped.end()) dropped.push_back(id);
    std::vector<std::string> rest;
    for (const auto& id : members)
      if (std::find(dropped.begin(), dropped.end(), id) == dropped.end()) rest.push_back(id);
    if (!dropped.empty() && !rest.empty()) {
      PC_WARN("publisher: forming the group again without " << join_ids(dropped) << " (" << comm.status().message()
                                                            << ")");
      Status again = form_group(cap, retries - 1, &rest);
      return again.ok() ? again : again.with_context(comm.status().message() + "; then");
    }
  }
  if (!comm.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    needs_reform_ = true;
    return comm.status();
  }
  comm_ = reaper_.adopt(std::move(comm.value()));
  return Status();
}

// Re-forms the group when membership changed since the last one, after
// giving lost members up to one heartbeat timeout to come back.
Status PublisherImpl::ensure_group() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!needs_reform_ && comm_) {
      // A quarantine that ended brings its member back with a new group.
      std::map<std::string, std::string> excluded;
      lock.unlock();
      auto wanted = wanted_members(&excluded);
      lock.lock();
      // The same members in another order is no reason to form again: a slow
      // member moves to a leaf at the next formation.
      auto current = group_;
      std::sort(wanted.begin(), wanted.end());
      std::sort(current.begin(), current.end());
      if (wanted == current) return Status();
      needs_reform_ = true;
    }
    // With on_member_loss: continue, only the members of the last group
    // that are gone are waited for (a restart comes back within it): not
    // count slots never filled, nor identities that came and went.
    const bool fail = cfg_.publisher.on_member_loss == MemberLossPolicy::kFail;
    cv_.wait_until(lock, Clock::now() + cfg_.control.heartbeat_timeout, [&] {
      if (stopped_ || fail) return stopped_ || server_.missing().empty();
      return std::all_of(group_.begin(), group_.end(), [&](const std::string& id) { return server_.is_live(id); });
    });
  }
  auto missing = server_.missing();
  if (!missing.empty() && cfg_.publisher.on_member_loss == MemberLossPolicy::kFail)
    return peer_lost("subscribers missing (on_member_loss: fail): " + join_ids(missing));
  probe_data_suspects();
  const auto excluded = groups_.excluded();
  if (!excluded.empty() && cfg_.publisher.on_member_loss == MemberLossPolicy::kFail) {
    std::string what;
    for (const auto& [id, why] : excluded) what += (what.empty() ? "" : "; ") + id + ": " + why;
    return unavailable("subscribers in quarantine after failing group formations (on_member_loss: fail): " + what);
  }
  return form_group(cap_);
}

// The members the last failed update named prove their data path before
// this formation (a link check, about 3 s at most): one that cannot is in
// quarantine now, and the formation goes without it instead of spending
// init_timeout on it (group_host.h, probe_data_paths).
void PublisherImpl::probe_data_suspects() {
  std::map<std::string, std::string> suspects;
  {
    std::lock_guard<std::mutex> lock(mu_);
    suspects.swap(data_suspects_);
  }
  groups_.probe_data_paths(suspects);
}

// A many-sender group of trainer ranks only reaches nobody: the update
// fails as a single sender's with no subscriber does (UNAVAILABLE, "no live
// subscriber to form a group with"), naming the engines that are absent.
Status PublisherImpl::some_engine_in_group() const {
  std::vector<std::string> group;
  {
    std::lock_guard<std::mutex> lock(mu_);
    group = group_;
  }
  std::string ranks;
  for (const auto& id : group) {
    if (!is_job_source(id)) return Status();
    ranks += (ranks.empty() ? "" : ", ") + id;
  }
  const auto away = absent();
  return unavailable("sharded update refused before any byte moved: no engine in the group to receive it (" +
                     (ranks.empty() ? std::string("no trainer rank either") : "trainer ranks only: " + ranks) +
                     (away.empty() ? std::string() : "; absent: " + join_ids(away)) +
                     "), as a single sender with no live subscriber; it goes on once an engine joins");
}

// Expected subscribers that are not in this update: absent, or left out of
// the group after failing formation.
std::vector<std::string> PublisherImpl::absent() const {
  // A member left out of the group may also be between connections at this
  // moment: it is absent once.
  auto ids = server_.missing();
  for (const auto& [id, why] : groups_.excluded())
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  return ids;
}

}  // namespace paramcast
