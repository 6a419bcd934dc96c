// UpdateRound: what the members of the group answered for the update in
// flight (PlanAccept / PlanReject, then Applied), and the per-subscriber
// outcomes built from those answers when the publisher stops waiting.
//
// Thread-safety: none of its own; the publisher guards it with the lock it
// shares with the control thread.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/data/communicator.h"
#include "common/plan.h"
#include "common/control/control_server.h"
#include "common/status.h"
#include "schemas/control.capnp.h"
#include "trainer_side/publisher.h"

namespace paramcast {

class UpdateRound {
 public:
  // Of a member's PlanReject the publisher keeps this many mismatches and
  // counts the rest (a refusal costs no more than that, whatever it lists);
  // a failure's text names the first kNamedMismatches.
  static constexpr size_t kKeptMismatches = 64, kNamedMismatches = 4;
  using IsLive = std::function<bool(const std::string& id)>;

  // What a member's heartbeats said of its control messages (the highest
  // version whose Plan arrived, whose answer, Commit and Applied it queued).
  struct Markers {
    uint64_t plan = 0, answered = 0, commit = 0, applied = 0;
  };
  // `total_bytes`: the plan's, the most any member can have moved.
  // `before`: markers that are no evidence in this round (another attempt
  // at the same version may have left them): a marker counts only above them.
  void begin(uint64_t epoch, uint64_t version, std::vector<std::string> group, uint64_t total_bytes,
             std::map<std::string, Markers> before = {});
  void end() { version_ = 0; }
  // The Plan / the Commit (or precommitted Plan) left after heartbeat `seq`
  // (ControlServer::send_to).
  void sent_plan(uint64_t seq) { plan_seq_ = seq; }
  void sent_commit(uint64_t seq) {
    commit_seq_ = seq;
    committed_ = true;
  }
  uint64_t version() const { return version_; }
  const std::vector<std::string>& group() const { return group_; }
  // The inbound links the members reported forwarding on (Applied.links),
  // by the receiving rank: the figures of every rank whose parent in the
  // broadcast tree is a member. A rank two members claim is left out (one
  // of them is wrong).
  struct InboundLink {
    int parent = -1;  // the reporting member's rank
    LinkStats link;   // peer: the receiving rank
  };
  // `credible(parent, child)`: whether the reporting rank can speak for that
  // link (it is the child's parent on its plane); others are dropped before
  // a link claimed twice is dropped, so a forged claim cannot cancel a true one.
  std::map<int, InboundLink> reported_links(const std::function<bool(int, int)>& credible = {}) const;

  // A PlanAccept, PlanReject or Applied from `id` for this round; returns
  // false for anything else (another message, epoch or version).
  bool record(const std::string& id, proto::Envelope::Reader envelope);
  // A heartbeat from `id` (its row in the membership table): notes a Plan,
  // Commit, answer or Applied lost on the control channel. Returns the text
  // when it newly found one (the member then counts as answered, with a
  // TIMEOUT outcome), else "".
  std::string observe(const std::string& id, const control::Member& m);
  bool committed() const { return committed_; }

  // Every live member has answered the plan / reported Applied.
  bool plan_answered(const IsLive& live) const;
  bool applied(const IsLive& live) const;
  bool applied_ok(const std::string& id) const;
  // When each member's successful Applied arrived.
  std::map<std::string, Clock::time_point> applied_ok_times() const;
  // The member whose Applied came last, and when (empty: none came).
  std::pair<std::string, Clock::time_point> last_applied() const;
  // Said nothing of its Applied: no report, and no heartbeat telling of one.
  bool silent_on_applied(const std::string& id) const { return !applied_.count(id) && !missed_.count(id); }

  // Outcomes after the accept round; `lost` and `rejected` say why it cannot go on.
  // `code`: REJECTED when a member rejected it, else PEER_LOST when one was
  // lost, else TIMEOUT when one missed a message or did not answer; OK when
  // the update can go on.
  // `deadline`: how long the publisher waited, for the message of a member
  // that did not answer ("within plan_timeout (5s)").
  std::vector<SubscriberOutcome> plan_outcomes(const IsLive& live, const std::string& silence, Code& code,
                                               const std::string& deadline = "before update_timeout") const;
  // Outcomes after the data moved (`data` is this rank's own data-plane
  // result). `code` says what the caller should act on first: PEER_LOST for a
  // member the control plane declared lost, else TIMEOUT for one that missed
  // a message or did not report, else this rank's data-plane failure, else
  // the first member's failure; OK when every member applied.
  std::vector<SubscriberOutcome> applied_outcomes(const IsLive& live, const std::string& silence,
                                                  const Status& data, Code& code,
                                                  const std::string& deadline = "before update_timeout") const;

 private:
  struct PlanAnswer {
    bool accepted = false;
    std::vector<Mismatch> mismatches;  // the first kKeptMismatches
    size_t more = 0;                   // the count of those not kept
  };
  struct AppliedAnswer {
    uint64_t bytes = 0;
    double seconds = 0;
    std::vector<LinkStats> links;  // what it forwarded, per child (peer = the child's rank)
    Status status;
    Clock::time_point at;  // when it arrived
  };
  bool record_applied(const std::string& id, proto::Applied::Reader a);

  uint64_t epoch_ = 0;
  uint64_t version_ = 0;  // 0: no round open
  uint64_t total_bytes_ = 0;
  uint64_t plan_seq_ = 0, commit_seq_ = 0;
  bool committed_ = false;
  std::map<std::string, std::string> missed_;  // lost control messages, per member
  std::map<std::string, Markers> before_;       // markers when the round began
  std::vector<std::string> group_;
  std::map<std::string, PlanAnswer> plan_;
  std::map<std::string, AppliedAnswer> applied_;
};

// "<head>: <first failure>; <second failure>..." with `code`.
Status summarize_outcomes(const std::vector<SubscriberOutcome>& outcomes, Code code, const std::string& head);
// The code of an update whose shed and delta-refusing members do not fail it.
Code others_code(const std::vector<SubscriberOutcome>& outcomes);

}  // namespace paramcast
