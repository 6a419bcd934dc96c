// ControlFaults: a test hook that makes a real subscriber lose chosen control
// messages, as a connection that breaks at the wrong moment would (ZeroMQ
// drops what was queued on a broken connection). Read from the environment
// when a Subscriber is created:
//
//   PARAMCAST_FAULT_LOSE=plan:2,commit:3   lose the Plan of v2 and the Commit of v3 on arrival
//   PARAMCAST_FAULT_LOSE=answer:2          lose this worker's PlanAccept/PlanReject of v2
//   PARAMCAST_FAULT_LOSE=applied:4         lose this worker's Applied of v4
//   PARAMCAST_FAULT_LOSE=mute-answer:2     never answer the Plan of v2, and say so in no heartbeat
//   PARAMCAST_FAULT_LOSE=mute-applied:2    never report Applied for v2, and say so in no heartbeat
//                                          (a member alive but stuck: the phase deadlines name it)
//
// Each named message is lost once. The publisher is expected to notice from
// heartbeats (docs/protocol.md, "Lost control messages").
//
//   PARAMCAST_FAULT_REFUSE_DELTA=1         refuse every delta plan while Hello and heartbeats
//                                          go on claiming this engine takes deltas (a lying member)
//   PARAMCAST_FAULT_CLAIM_VERSION=N        claim to hold version N in Hello and heartbeats
//   PARAMCAST_FAULT_CLAIM_VERSION=+1       once it holds a version, claim one above it
//   PARAMCAST_FAULT_CLAIM_SHED=a,b         report in every Applied that it shed members a and b
//                                          (forged link claims; the publisher must check them)
//   PARAMCAST_FAULT_REFUSE_SLICES=1        refuse every sharded plan, naming its first slice, although
//                                          the plan gives it exactly the slices its Wants asked for
//                                          (a lying engine)
//   PARAMCAST_FAULT_REPLAY_HOLDINGS=1      a trainer rank sends, right after each call's Holdings,
//                                          its previous call's Holdings again (an older seq and
//                                          step, as a delayed duplicate would arrive)
//   PARAMCAST_FAULT_BLOAT_HOLDINGS=N:S     a trainer rank's Holdings of step S state N more
//                                          tensors than it holds ("bloat/<i>", F32[1], each held
//                                          whole, no data behind them): a message as large as the
//                                          control plane lets through
//   PARAMCAST_FAULT_FORGE_PART=S           a trainer rank's Holdings of step S refer to a part it
//                                          never sent (Holdings.shapeRef of another digest)
//   PARAMCAST_FAULT_DIGEST_PAST=S          a trainer rank's Holdings of step S by reference carry
//                                          one digest, of a box past the part's last
#pragma once

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <utility>

namespace paramcast {

class ControlFaults {
 public:
  static ControlFaults from_env() {
    ControlFaults f;
    const char* v = std::getenv("PARAMCAST_FAULT_LOSE");
    std::stringstream in(v ? v : "");
    std::string item;
    while (std::getline(in, item, ',')) {
      const auto colon = item.find(':');
      if (colon == std::string::npos) continue;
      f.lose_.insert({item.substr(0, colon), std::strtoull(item.c_str() + colon + 1, nullptr, 10)});
    }
    const char* slices = std::getenv("PARAMCAST_FAULT_REFUSE_SLICES");
    f.refuse_slices_ = slices && std::string(slices) == "1";
    const char* replay = std::getenv("PARAMCAST_FAULT_REPLAY_HOLDINGS");
    f.replay_holdings_ = replay && std::string(replay) == "1";
    const char* refuse = std::getenv("PARAMCAST_FAULT_REFUSE_DELTA");
    f.refuse_delta_ = refuse && std::string(refuse) == "1";
    if (const char* shed = std::getenv("PARAMCAST_FAULT_CLAIM_SHED")) {
      std::stringstream ids(shed);
      for (std::string id; std::getline(ids, id, ',');)
        if (!id.empty()) f.claim_shed_.insert(id);
    }
    if (const char* bloat = std::getenv("PARAMCAST_FAULT_BLOAT_HOLDINGS")) {
      char* end = nullptr;
      f.bloat_tensors_ = std::strtoull(bloat, &end, 10);
      f.bloat_step_ = end && *end == ':' ? std::strtoull(end + 1, nullptr, 10) : 0;
    }
    if (const char* forge = std::getenv("PARAMCAST_FAULT_FORGE_PART")) f.forge_step_ = std::strtoull(forge, nullptr, 10);
    if (const char* past = std::getenv("PARAMCAST_FAULT_DIGEST_PAST")) f.digest_past_step_ = std::strtoull(past, nullptr, 10);
    if (const char* claim = std::getenv("PARAMCAST_FAULT_CLAIM_VERSION")) {
      f.claim_relative_ = claim[0] == '+';
      f.claim_ = std::strtoull(claim + (f.claim_relative_ ? 1 : 0), nullptr, 10);
    }
    return f;
  }
  ControlFaults() = default;
  ControlFaults(const ControlFaults& o)
      : lose_(o.lose_),
        refuse_delta_(o.refuse_delta_),
        replay_holdings_(o.replay_holdings_),
        refuse_slices_(o.refuse_slices_),
        bloat_tensors_(o.bloat_tensors_),
        bloat_step_(o.bloat_step_),
        forge_step_(o.forge_step_),
        claim_(o.claim_),
        claim_relative_(o.claim_relative_),
        claim_shed_(o.claim_shed_) {}

  // Whether to lose `what` ("plan", "commit", "answer", "applied") of `version`; true once.
  bool loses(const std::string& what, uint64_t version) {
    if (lose_.empty()) return false;
    std::lock_guard<std::mutex> lock(mu_);
    return lose_.erase({what, version}) > 0;
  }
  // Whether to refuse every delta plan (PARAMCAST_FAULT_REFUSE_DELTA=1).
  bool refuses_delta() const { return refuse_delta_; }
  // Whether to send each call's Holdings again after the next (PARAMCAST_FAULT_REPLAY_HOLDINGS=1).
  bool replays_holdings() const { return replay_holdings_; }
  // How many tensors to state beyond those held in the Holdings of `step` (PARAMCAST_FAULT_BLOAT_HOLDINGS).
  uint64_t bloats_holdings(uint64_t step) const { return step == bloat_step_ ? bloat_tensors_ : 0; }
  // Whether the Holdings of `step` refer to a part never sent (PARAMCAST_FAULT_FORGE_PART).
  bool forges_part(uint64_t step) const { return forge_step_ && step == forge_step_; }
  // Whether the Holdings of `step` by reference digest a box past the part (PARAMCAST_FAULT_DIGEST_PAST).
  bool digests_past(uint64_t step) const { return digest_past_step_ && step == digest_past_step_; }
  // Whether to refuse every sharded plan over its slices (PARAMCAST_FAULT_REFUSE_SLICES=1).
  bool refuses_slices() const { return refuse_slices_; }
  // The members this one claims it shed (PARAMCAST_FAULT_CLAIM_SHED).
  const std::set<std::string>& claimed_shed() const { return claim_shed_; }
  // The version to claim instead of `held` (PARAMCAST_FAULT_CLAIM_VERSION).
  uint64_t claimed_version(uint64_t held) const {
    if (!claim_) return held;
    if (claim_relative_) return held ? held + claim_ : held;
    return claim_;
  }

 private:
  std::mutex mu_;
  std::set<std::pair<std::string, uint64_t>> lose_;
  bool refuse_delta_ = false;
  bool replay_holdings_ = false;
  bool refuse_slices_ = false;
  uint64_t bloat_tensors_ = 0;
  uint64_t bloat_step_ = 0;
  uint64_t forge_step_ = 0;
  uint64_t digest_past_step_ = 0;
  uint64_t claim_ = 0;
  bool claim_relative_ = false;
  std::set<std::string> claim_shed_;
};

}  // namespace paramcast
