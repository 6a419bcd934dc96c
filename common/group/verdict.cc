// GroupHost's verdict (group_host.h): after a failed formation, who is named
// and why, from what the members said, this rank's own evidence and who is
// still live; the evidence weighed by attribution.h.
#include "common/group/attribution.h"
#include "common/group/group_host.h"

#include <algorithm>

namespace paramcast::group {

// What judge() finds, step by step.
struct GroupHost::Findings {
  std::map<std::string, std::string> named;  // member -> why
  std::set<std::string> conclusive;          // named on conclusive evidence: quarantined at once
  std::set<std::string> data_path;           // named for their data path (a passing link check may end it early)
  std::vector<std::string> problems;         // said, held against nobody
  std::vector<std::string> left;             // left out by what no evidence separates
};

// Weighs what the formation showed. Named: the members the evidence points
// at (attribution.h), those that failed on their own (a GroupFailed without
// evidence), lied about being ready, were lost, or (when nothing ended the
// formation early) were not ready by the deadline. The members that reported
// evidence against others are witnesses, not culprits.
std::vector<std::string> GroupHost::judge(const std::vector<std::string>& members, const FormationEvidence& own,
                                          bool own_failed, bool ended_early) {
  std::vector<std::string> names = {"publisher"};
  names.insert(names.end(), members.begin(), members.end());
  Findings f;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Verdict verdict = attribute_locked(names, own, own_failed);
    name_blamed_locked(verdict, names, f);
    leave_out_locked(verdict, names, f);
    name_failed_alone_locked(members, f);
    if (!ended_early) name_not_ready_locked(members, f);
    if (stopped_) f.problems.push_back("publisher shutting down");
  }
  // A member's evidence that named nobody (its peers reached everyone else)
  // still failed the formation: say what it reported.
  if (f.named.empty() && f.problems.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, why] : failed_) f.problems.push_back(id + ": " + why);
  }
  std::vector<std::string> out;
  for (const auto& id : members)
    if (f.named.count(id)) out.push_back(id + ": " + f.named[id]);
  out.insert(out.end(), f.problems.begin(), f.problems.end());
  count_strikes(members, f.named, f.conclusive, f.data_path);
  ensure_checks();
  {
    std::lock_guard<std::mutex> lock(mu_);
    last_conclusive_.insert(last_conclusive_.end(), f.left.begin(), f.left.end());
  }
  return out;
}

// Every rank's report, whose word covers every peer, and the recent lone
// accusations, weighed (attribution.h); this verdict's lone accusations are
// kept for the formations that follow.
Verdict GroupHost::attribute_locked(const std::vector<std::string>& names, const FormationEvidence& own,
                                    bool own_failed) {
  std::map<int, RankReport> reports;
  if (own_failed) reports[0] = RankReport{own.unreachable, own.no_address};
  // Whose word covers every peer: this rank when its mesh formed, or failed
  // on evidence or after every pair connected; a member that was ready, or
  // failed so. A failure otherwise is no such word (a formation cut short:
  // its sender's pairs may not all have formed).
  std::set<int> complete;
  if (!own_failed || !own.empty() || own.connected) complete.insert(0);
  for (const auto& [id, e] : evidence_) {
    auto rank = assigned_rank_.find(id);
    if (rank != assigned_rank_.end()) reports[rank->second] = RankReport{e.unreachable, e.no_address};
  }
  for (const auto& [id, rank] : assigned_rank_)
    if (evidence_.count(id) || connected_.count(id) || (ready_.count(id) && !false_ready_.count(id)))
      complete.insert(rank);
  const int world = static_cast<int>(names.size());
  const Verdict verdict = attribute(world, reports, complete, turn_, earlier_accusations_locked(names));
  for (const auto& [accused, accuser] : verdict.lone)
    accused_by_[names[static_cast<size_t>(accused)]][names[static_cast<size_t>(accuser)]] =
        Clock::now() + cfg_.publisher.quarantine_backoff;
  return verdict;
}

// By rank: how many members not in this formation accused it alone in
// recent formations. Expired accusations go.
std::map<int, size_t> GroupHost::earlier_accusations_locked(const std::vector<std::string>& names) {
  std::map<int, size_t> earlier;
  const auto now = Clock::now();
  std::map<std::string, int> rank_of;
  for (size_t r = 1; r < names.size(); ++r) rank_of[names[r]] = static_cast<int>(r);
  for (auto it = accused_by_.begin(); it != accused_by_.end();) {
    for (auto a = it->second.begin(); a != it->second.end();)  // bounded: expired ones go
      a = a->second <= now ? it->second.erase(a) : std::next(a);
    if (it->second.empty()) {
      it = accused_by_.erase(it);
      continue;
    }
    if (auto v = rank_of.find(it->first); v != rank_of.end())
      for (const auto& [accuser, until] : it->second)
        if (!rank_of.count(accuser)) ++earlier[v->second];
    ++it;
  }
  return earlier;
}

// The members the evidence points at, named with it; conclusive on this
// rank's own connects, or on two or more peers' word.
void GroupHost::name_blamed_locked(const Verdict& verdict, const std::vector<std::string>& names, Findings& f) {
  for (const auto& b : verdict.blamed) {
    if (b.rank == 0) continue;  // rank 0 is this process: never blamed by attribution
    const std::string& id = names[static_cast<size_t>(b.rank)];
    f.named[id] = describe(b, names);
    f.data_path.insert(id);
    // On the shm plane, "unreachable from the publisher" means it never
    // took the segment: no data port, no address.
    if (on_shm_plane(b.rank) && std::count(b.unreachable_from.begin(), b.unreachable_from.end(), 0))
      f.named[id] = "did not attach to the publisher's shared memory (shm plane) within init_timeout";
    // This rank's own connects, or two or more peers: conclusive.
    const bool by_publisher = std::count(b.unreachable_from.begin(), b.unreachable_from.end(), 0) ||
                              std::count(b.address_missed_by.begin(), b.address_missed_by.end(), 0);
    if (by_publisher || b.unreachable_from.size() + b.address_missed_by.size() + b.claims_unreachable.size() >= 2)
      f.conclusive.insert(id);
  }
}

// What no evidence separates: nobody named, some members left out for a
// while (the sides of a tie take turns), never struck.
void GroupHost::leave_out_locked(const Verdict& verdict, const std::vector<std::string>& names, Findings& f) {
  if (!verdict.sides.empty()) ++turn_;
  for (auto it = left_out_.begin(); it != left_out_.end();)  // bounded: expired ones go
    it = it->second.until <= Clock::now() ? left_out_.erase(it) : std::next(it);
  const auto until = Clock::now() + cfg_.publisher.quarantine_backoff;
  const auto lines = describe_left_out(verdict, names);
  f.problems.insert(f.problems.end(), lines.begin(), lines.end());
  for (int rank : verdict.left_out) {
    const std::string& id = names[static_cast<size_t>(rank)];
    left_out_[id] = LeftOut{"left out after a failed formation the evidence could not attribute", until};
    f.left.push_back(id);
  }
}

// The members not named by the evidence that lied about being ready, failed
// on their own, or were lost. A member that failed without evidence after
// the formation's first failure most likely failed because of it (a peer
// that gave up closed its pairs, and Gloo names no peer then): said, not
// held against it. The first failure is its sender's own.
void GroupHost::name_failed_alone_locked(const std::vector<std::string>& members, Findings& f) {
  for (const auto& id : members) {
    if (f.named.count(id)) continue;
    if (false_ready_.count(id)) {
      f.named[id] = kFalseReady;
      f.conclusive.insert(id);
    } else if (failed_alone_.count(id) && first_failed_ != id) {
      f.problems.push_back(id + " also failed (" + failed_[id] + "), after " + first_failed_ +
                           "'s failure: not held against it");
    } else if (failed_.count(id) && !evidence_.count(id)) {
      f.named[id] = failed_[id];
    } else if (const char* why = gone_locked(id)) {
      f.named[id] = why;
    }
  }
}

// Nothing ended the formation early: the members neither ready nor failed by
// the deadline, named for their data path.
void GroupHost::name_not_ready_locked(const std::vector<std::string>& members, Findings& f) {
  const std::string bound = "init_timeout (" + std::to_string(cfg_.data_plane.init_timeout.count()) + "ms)";
  for (const auto& id : members) {
    if (f.named.count(id) || ready_.count(id) || failed_.count(id)) continue;
    const auto rank = assigned_rank_.find(id);
    const bool gloo =
        cfg_.data_plane.backend == Backend::kGloo && !(rank != assigned_rank_.end() && on_shm_plane(rank->second));
    f.named[id] = gloo && !published_.count(id) ? "never published its rendezvous address within " + bound
                                                : "not ready within " + bound;
    f.data_path.insert(id);
  }
}

}  // namespace paramcast::group
