#include "trainer_side/update_round.h"

#include <algorithm>
#include <set>

#include "common/plan_proto.h"

namespace paramcast {

void UpdateRound::begin(uint64_t epoch, uint64_t version, std::vector<std::string> group, uint64_t total_bytes,
                        std::map<std::string, Markers> before) {
  before_ = std::move(before);
  epoch_ = epoch;
  version_ = version;
  total_bytes_ = total_bytes;
  group_ = std::move(group);
  plan_.clear();
  applied_.clear();
  missed_.clear();
  plan_seq_ = commit_seq_ = 0;
  committed_ = false;
}

std::string UpdateRound::observe(const std::string& id, const control::Member& m) {
  if (version_ == 0 || missed_.count(id) || std::find(group_.begin(), group_.end(), id) == group_.end()) return "";
  const std::string v = std::string("v") + std::to_string(version_);
  // A marker at this version counts only if it was not already there when
  // the round began (an earlier attempt at the same version left it).
  const Markers was = before_.count(id) ? before_.at(id) : Markers{};
  const bool answered = m.answered_version >= version_ && was.answered < version_;
  const bool applied = m.applied_version >= version_ && was.applied < version_;
  std::string what;
  if (!committed_ && !plan_.count(id)) {
    if (m.ack_seq > plan_seq_ && m.plan_version < version_) what = "did not receive the plan of " + v;
    else if (answered) what = "answered the plan of " + v + " but the answer never arrived";
  } else if (committed_ && !applied_.count(id)) {
    if (m.ack_seq > commit_seq_ && m.commit_version < version_) {
      what = "did not receive the commit of " + v;
    } else if (m.applied_version >= version_) {
      // Its Applied was lost; its heartbeat says what the update left behind
      // (consistent at v: applied, whichever attempt's marker this is, since
      // an earlier attempt at v applied nothing or the round would not repeat).
      if (m.weight_version >= version_ && m.state == proto::WeightState::CONSISTENT) {
        applied_[id] = AppliedAnswer{};
        return "";
      }
      if (applied)
        what = "reported " + v + " done but its Applied never arrived, and its weights are not consistent at " + v;
    }
  }
  if (what.empty()) return "";
  missed_[id] = "subscriber '" + id + "' " + what + " (a control message was lost; its heartbeats show it)";
  return missed_[id];
}

bool UpdateRound::record(const std::string& id, proto::Envelope::Reader env) {
  using B = proto::Envelope::Body;
  auto body = env.getBody();
  if (version_ == 0 || env.getEpoch() != epoch_) return false;
  switch (body.which()) {
    case B::PLAN_ACCEPT:
      if (body.getPlanAccept().getVersion() != version_) return false;
      plan_[id].accepted = true;
      return true;
    case B::PLAN_REJECT: {
      auto pr = body.getPlanReject();
      if (pr.getVersion() != version_) return false;
      PlanAnswer a;
      for (auto m : pr.getMismatches()) {
        if (a.mismatches.size() == kKeptMismatches) {
          a.more = pr.getMismatches().size() - kKeptMismatches;
          break;
        }
        a.mismatches.push_back(Mismatch{mismatch_kind_from_proto(m.getKind()), m.getName().cStr(),
                                        m.getExpected().cStr(), m.getGot().cStr()});
      }
      plan_[id] = std::move(a);
      return true;
    }
    case B::APPLIED:
      return record_applied(id, body.getApplied());
    default:
      return false;
  }
}

std::map<int, UpdateRound::InboundLink> UpdateRound::reported_links(
    const std::function<bool(int, int)>& credible) const {
  std::map<int, InboundLink> out;
  std::set<int> claimed_twice;
  for (const auto& [id, a] : applied_) {
    const auto at = std::find(group_.begin(), group_.end(), id);
    if (at == group_.end()) continue;
    const int parent = static_cast<int>(at - group_.begin()) + 1;  // group_[i] is rank i + 1
    for (const auto& l : a.links) {
      if (credible && !credible(parent, l.peer)) continue;
      if (!out.emplace(l.peer, InboundLink{parent, l}).second) claimed_twice.insert(l.peer);
    }
  }
  for (int rank : claimed_twice) out.erase(rank);
  return out;
}

bool UpdateRound::record_applied(const std::string& id, proto::Applied::Reader a) {
  if (a.getVersion() != version_) return false;
  AppliedAnswer ans;
  ans.at = Clock::now();
  ans.bytes = std::min(a.getBytes(), total_bytes_);  // from the network: at most the update's bytes
  ans.seconds = static_cast<double>(a.getReceiveMs()) / 1000.0;
  // From the network: a member has fewer children than the group has
  // members (a longer list is ignored whole); only ranks of this group, one
  // entry per rank, bytes at most the plan's, busy time bounded.
  const auto links = a.getLinks();
  if (links.size() <= group_.size()) {
    std::vector<bool> seen(group_.size() + 1, false);
    for (auto l : links) {
      const uint32_t rank = l.getRank();
      if (rank == 0 || rank > group_.size() || seen[rank]) continue;
      seen[rank] = true;
      LinkStats s;
      s.peer = static_cast<int>(rank);
      s.bytes_sent = std::min(l.getBytes(), total_bytes_);
      s.send_busy = std::chrono::microseconds(std::min<uint64_t>(l.getBusyUs(), uint64_t(1) << 40));
      s.shed = l.getShed();
      ans.links.push_back(s);
    }
  }
  if (!a.getOk()) {
    // An error code that is not a failure code still reports a failure.
    auto code = static_cast<Code>(a.getErrorCode());
    if (code == Code::kOk || a.getErrorCode() > static_cast<uint32_t>(Code::kInternal)) code = Code::kInternal;
    ans.status = Status(code, "subscriber '" + id + "': " + a.getError().cStr());
  }
  applied_[id] = ans;
  return true;
}

bool UpdateRound::plan_answered(const IsLive& live) const {
  for (const auto& id : group_)
    if (!plan_.count(id) && !missed_.count(id) && live(id)) return false;
  return true;
}

bool UpdateRound::applied(const IsLive& live) const {
  for (const auto& id : group_)
    if (!applied_.count(id) && !missed_.count(id) && live(id)) return false;
  return true;
}

std::map<std::string, Clock::time_point> UpdateRound::applied_ok_times() const {
  std::map<std::string, Clock::time_point> out;
  for (const auto& [id, a] : applied_)
    if (a.status.ok() && a.at != Clock::time_point{}) out[id] = a.at;
  return out;
}

std::pair<std::string, Clock::time_point> UpdateRound::last_applied() const {
  std::pair<std::string, Clock::time_point> out;
  for (const auto& [id, a] : applied_)
    if (out.first.empty() || a.at > out.second) out = {id, a.at};
  return out;
}

bool UpdateRound::applied_ok(const std::string& id) const {
  auto it = applied_.find(id);
  return it != applied_.end() && it->second.status.ok();
}

std::vector<SubscriberOutcome> UpdateRound::plan_outcomes(const IsLive& live, const std::string& silence,
                                                          Code& code, const std::string& deadline) const {
  std::vector<SubscriberOutcome> out;
  bool rejected_any = false, lost_any = false, missed_any = false;
  for (const auto& id : group_) {
    SubscriberOutcome o;
    o.worker_id = id;
    auto answer = plan_.find(id);
    if (!live(id)) {
      o.status = peer_lost("subscriber '" + id + "' was lost (" + silence + ")");
      lost_any = true;
    } else if (answer == plan_.end()) {
      auto missed = missed_.find(id);
      o.status = timeout_error(missed != missed_.end()
                                   ? missed->second
                                   : "subscriber '" + id + "' did not answer the plan " + deadline);
      missed_any = true;
    } else if (!answer->second.accepted) {
      o.mismatches = answer->second.mismatches;
      std::string text;
      for (size_t i = 0; i < o.mismatches.size() && i < kNamedMismatches; ++i)
        text += (text.empty() ? "" : "; ") + o.mismatches[i].to_string();
      if (const size_t rest = o.mismatches.size() + answer->second.more - std::min(o.mismatches.size(), kNamedMismatches))
        text += "; and " + std::to_string(rest) + " more";
      o.status = rejected("subscriber '" + id + "' rejected the plan: " + text);
      rejected_any = true;
    }
    out.push_back(std::move(o));
  }
  code = rejected_any ? Code::kRejected : lost_any ? Code::kPeerLost : missed_any ? Code::kTimeout : Code::kOk;
  return out;
}

std::vector<SubscriberOutcome> UpdateRound::applied_outcomes(const IsLive& live, const std::string& silence,
                                                             const Status& data, Code& code,
                                                             const std::string& deadline) const {
  std::vector<SubscriberOutcome> out;
  bool lost_any = false, missed_any = false;
  Code first = Code::kOk;
  for (const auto& id : group_) {
    SubscriberOutcome o;
    o.worker_id = id;
    auto a = applied_.find(id);
    if (a != applied_.end()) {
      o.bytes = a->second.bytes;
      o.seconds = a->second.seconds;
      o.status = a->second.status;
      auto answer = plan_.find(id);
      if (answer != plan_.end()) o.mismatches = answer->second.mismatches;  // a precommitted plan rejected
    } else if (!live(id)) {
      o.status = peer_lost("subscriber '" + id + "' was lost during update v" + std::to_string(version_) + " (" +
                           silence + ")");
      lost_any = true;
    } else if (auto missed = missed_.find(id); missed != missed_.end()) {
      o.status = timeout_error(missed->second);
      missed_any = true;
    } else {
      o.status = timeout_error("subscriber '" + id + "' did not report applied v" + std::to_string(version_) +
                               (data.ok() ? " " + deadline : " after the data plane failed"));
      if (data.ok()) missed_any = true;
    }
    // PEER_LOST is the control plane's word: a data-plane connection that
    // broke under a member the heartbeats still hear is an aborted collective.
    if (o.status.code() == Code::kPeerLost && live(id)) o.status = Status(Code::kAborted, o.status.message());
    if (o.status.code() == Code::kTimeout) missed_any = true;
    if (first == Code::kOk && !o.status.ok()) first = o.status.code();
    out.push_back(std::move(o));
  }
  const Code data_code = data.code() == Code::kPeerLost ? Code::kAborted : data.code();
  code = lost_any                                       ? Code::kPeerLost
         : missed_any || data_code == Code::kTimeout    ? Code::kTimeout
         : !data.ok()                                   ? data_code
                                                        : first;
  return out;
}

// The update's code from the members that were not shed and did not refuse
// a delta they claimed: what the others say.
Code others_code(const std::vector<SubscriberOutcome>& outcomes) {
  Code code = Code::kOk;
  for (const auto& o : outcomes) {
    if (!o.shed && !o.refused_delta && !o.unconfirmed && !o.status.ok() &&
        (code == Code::kOk || o.status.code() == Code::kPeerLost))
      code = o.status.code();
  }
  return code;
}

Status summarize_outcomes(const std::vector<SubscriberOutcome>& outcomes, Code code, const std::string& head) {
  std::string msg = head;
  int failed = 0;
  for (const auto& o : outcomes)
    if (!o.status.ok()) msg += (failed++ ? "; " : ": ") + o.status.message();
  return Status(code, msg);
}

}  // namespace paramcast
