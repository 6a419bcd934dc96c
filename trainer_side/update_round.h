// UpdateRound: what the members of the group answered for the update in
// flight (PlanAccept / PlanReject, then Applied), and the per-subscriber
// outcomes built from those answers when the publisher stops waiting.
//
// Thread-safety: none of its own; the publisher guards it with the lock it
// shares with the control thread.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/plan.h"
#include "common/status.h"
#include "schemas/control.capnp.h"
#include "trainer_side/publisher.h"

namespace paramcast {

class UpdateRound {
 public:
  using IsLive = std::function<bool(const std::string& id)>;

  void begin(uint64_t epoch, uint64_t version, std::vector<std::string> group);
  void end() { version_ = 0; }
  uint64_t version() const { return version_; }
  const std::vector<std::string>& group() const { return group_; }

  // A PlanAccept, PlanReject or Applied from `id` for this round; returns
  // false for anything else (another message, epoch or version).
  bool record(const std::string& id, proto::Envelope::Reader envelope);

  // Every live member has answered the plan / reported Applied.
  bool plan_answered(const IsLive& live) const;
  bool applied(const IsLive& live) const;
  bool applied_ok(const std::string& id) const;

  // Outcomes after the accept round; `lost` and `rejected` say why it cannot go on.
  std::vector<SubscriberOutcome> plan_outcomes(const IsLive& live, const std::string& silence, bool& rejected,
                                               bool& lost) const;
  // Outcomes after the data moved (`data` is this rank's own data-plane result).
  std::vector<SubscriberOutcome> applied_outcomes(const IsLive& live, const std::string& silence,
                                                  const Status& data) const;

 private:
  struct PlanAnswer {
    bool accepted = false;
    std::vector<Mismatch> mismatches;
  };
  struct AppliedAnswer {
    uint64_t bytes = 0;
    Status status;
  };
  bool record_applied(const std::string& id, proto::Applied::Reader a);

  uint64_t epoch_ = 0;
  uint64_t version_ = 0;  // 0: no round open
  std::vector<std::string> group_;
  std::map<std::string, PlanAnswer> plan_;
  std::map<std::string, AppliedAnswer> applied_;
};

// "<head>: <first failure>; <second failure>..." with `code`.
Status summarize_outcomes(const std::vector<SubscriberOutcome>& outcomes, Code code, const std::string& head);

}  // namespace paramcast
