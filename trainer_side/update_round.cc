#include "trainer_side/update_round.h"

namespace paramcast {

void UpdateRound::begin(uint64_t epoch, uint64_t version, std::vector<std::string> group) {
  epoch_ = epoch;
  version_ = version;
  group_ = std::move(group);
  plan_.clear();
  applied_.clear();
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
      for (auto m : pr.getMismatches())
        a.mismatches.push_back(Mismatch{mismatch_kind_from_proto(m.getKind()), m.getName().cStr(),
                                        m.getExpected().cStr(), m.getGot().cStr()});
      plan_[id] = std::move(a);
      return true;
    }
    case B::APPLIED:
      return record_applied(id, body.getApplied());
    default:
      return false;
  }
}

bool UpdateRound::record_applied(const std::string& id, proto::Applied::Reader a) {
  if (a.getVersion() != version_) return false;
  AppliedAnswer ans;
  ans.bytes = a.getBytes();
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
    if (!plan_.count(id) && live(id)) return false;
  return true;
}

bool UpdateRound::applied(const IsLive& live) const {
  for (const auto& id : group_)
    if (!applied_.count(id) && live(id)) return false;
  return true;
}

bool UpdateRound::applied_ok(const std::string& id) const {
  auto it = applied_.find(id);
  return it != applied_.end() && it->second.status.ok();
}

std::vector<SubscriberOutcome> UpdateRound::plan_outcomes(const IsLive& live, const std::string& silence,
                                                          bool& rejected_any, bool& lost_any) const {
  std::vector<SubscriberOutcome> out;
  rejected_any = lost_any = false;
  for (const auto& id : group_) {
    SubscriberOutcome o;
    o.worker_id = id;
    auto answer = plan_.find(id);
    if (!live(id)) {
      o.status = peer_lost("subscriber '" + id + "' was lost (" + silence + ")");
      lost_any = true;
    } else if (answer == plan_.end()) {
      o.status = timeout_error("subscriber '" + id + "' did not answer the plan before update_timeout");
      lost_any = true;
    } else if (!answer->second.accepted) {
      o.mismatches = answer->second.mismatches;
      std::string text;
      for (const auto& m : o.mismatches) text += (text.empty() ? "" : "; ") + m.to_string();
      o.status = rejected("subscriber '" + id + "' rejected the plan: " + text);
      rejected_any = true;
    }
    out.push_back(std::move(o));
  }
  return out;
}

std::vector<SubscriberOutcome> UpdateRound::applied_outcomes(const IsLive& live, const std::string& silence,
                                                             const Status& data) const {
  std::vector<SubscriberOutcome> out;
  for (const auto& id : group_) {
    SubscriberOutcome o;
    o.worker_id = id;
    auto a = applied_.find(id);
    if (a != applied_.end()) {
      o.bytes = a->second.bytes;
      o.status = a->second.status;
      auto answer = plan_.find(id);
      if (answer != plan_.end()) o.mismatches = answer->second.mismatches;  // a precommitted plan rejected
    } else if (!live(id)) {
      o.status = peer_lost("subscriber '" + id + "' was lost during update v" + std::to_string(version_) + " (" +
                           silence + ")");
    } else {
      o.status = timeout_error("subscriber '" + id + "' did not report applied v" + std::to_string(version_) +
                               (data.ok() ? " before update_timeout" : " after the data plane failed"));
    }
    out.push_back(std::move(o));
  }
  return out;
}

Status summarize_outcomes(const std::vector<SubscriberOutcome>& outcomes, Code code, const std::string& head) {
  std::string msg = head;
  int failed = 0;
  for (const auto& o : outcomes)
    if (!o.status.ok()) msg += (failed++ ? "; " : ": ") + o.status.message();
  return Status(code, msg);
}

}  // namespace paramcast
