// GroupHost: group formation on the publisher's side.
//
// form() starts a new epoch: ranks (the publisher is rank 0, members 1..n in
// the given order), a fresh bootstrap (an ncclUniqueId, or a Gloo store
// prefix), JoinGroup to every member, this rank's communicator created
// against the HostedStore, and GroupReady from every member. It returns the
// communicator, or an error naming every member that failed (with its
// reason), was lost, never published its rendezvous address, or was not
// ready within data_plane.init_timeout.
//
// Formation fails fast and names the right member. Every rank's data-plane
// mesh is bounded by init_timeout (data/gloo/mesh.h). A formation's first
// failure (a GroupFailed, with evidence of the ranks its sender could not
// reach or without, or a false GroupReady) starts a short collection window
// (kEvidenceWindow, or until every member answered), in which this rank's
// own connects and the other members' reports still count: one member's
// failure is often the echo of another's (a peer that gave up closed its
// pairs), and a verdict on part of the word can name the wrong member. A
// member lost meanwhile ends the formation at once. Then every member is told with
// a GroupFailed of the epoch, and the evidence is weighed (attribution.h):
// the member the others could not reach, or whose address never reached
// them, is named with the evidence ("worker-5: unreachable from publisher,
// worker-1 on its data port"); the members that tried to reach it are not.
// A member that says GroupReady without having published its address lies,
// and is named for it.
// Quarantine follows the identity, not the connection: a member named by two
// failed formations in a row is left out of formations (excluded()) for
// publisher.quarantine_backoff, doubled for each further failure (at most
// 16x), then tried again; restarting or rejoining does not reset it. A member
// named on conclusive evidence (by this rank's own connects, by two or more
// peers, or for a false GroupReady) is quarantined at once, and
// last_conclusive() lists it, so that the caller can form again without it
// within the same update. A formation it is ready in (and not named) clears
// its strikes, as do 32 backoffs without a failure.
// On the Gloo plane a member out for strikes is tried again only once its
// data path passed a link check (link_check.h) after its last failure, so a
// still-broken member costs no formation when its backoff ends; one struck
// for a data-path failure (unreachable, its address missed, not ready) is
// tried again as soon as a check passes, before its backoff ends, once
// (until a formation it is ready in clears its strikes, it then serves
// every backoff in full). Only members that announced the "link_check"
// capability are checked; 32 backoffs after its last failure a member is
// tried again whatever its checks say. A formation that names
// every member strikes nobody: its evidence cannot tell which one is at fault.
// What the evidence cannot separate names nobody (attribution.h, step 3):
// the suspects of an accusation that more ranks contradict, or one side of a
// partition, are left out of formations for quarantine_backoff without a
// strike (excluded() lists them, last_conclusive() too), then tried again;
// on a tie the sides take turns.
//
// The rendezvous store is served here too: the owner routes StoreSet,
// StoreGet, GroupReady and GroupFailed from the control thread to
// on_message(), and member losses to on_member_gone().
//
// Threads: form() on the caller's thread (one at a time); on_message() and
// on_member_gone() on the control thread; the rest from any thread.
// Files: group_host.cc (formation), verdict.cc (the verdict: who is named
// and why), quarantine.cc (strikes, exclusion, link checks).
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/control/control_server.h"
#include "common/data/communicator.h"
#include "common/group/link_check.h"
#include "common/group/rendezvous_store.h"

namespace paramcast::group {

struct Verdict;  // attribution.h

class GroupHost {
 public:
  GroupHost(const Config& config, control::ControlServer& server);
  ~GroupHost();

  // `cap`: formation ends by then at the latest (the update's deadline),
  // and by data_plane.init_timeout from now.
  StatusOr<std::shared_ptr<Communicator>> form(const std::vector<std::string>& members,
                                               Clock::time_point cap = Clock::time_point::max());
  uint64_t epoch() const { return epoch_; }
  // The current group mixes the shm plane with the backend's (data_plane.local).
  bool mixed() const { return !local_.empty(); }
  // Rank-indexed: who reads this host's shared memory this epoch (empty:
  // not a mixed group). Update thread only, as form().
  const std::vector<bool>& local() const { return local_; }

  // Members in quarantine now, each with why and for how much longer.
  std::map<std::string, std::string> excluded(Clock::time_point now = Clock::now()) const;
  // The members the last failed formation named (empty after a success).
  std::vector<std::string> last_blamed() const;
  // Those of them named on conclusive evidence, now in quarantine, and the
  // members the evidence left out: forming again without them can succeed
  // at once.
  std::vector<std::string> last_conclusive() const;
  // Quarantines `id` at once (a member that broke the start-up formation).
  void quarantine(const std::string& id, const std::string& reason);
  // Members a failed update's data plane named (`suspects`, with why) prove
  // their data path before the next formation instead of costing it
  // init_timeout: each that can answer a link check gets one now; one whose
  // check fails, or does not end within kLinkCheckTimeout + 1 s, is
  // quarantined at once for a data-path failure (a later passing check lets
  // it out early). Blocks up to that bound. Returns those quarantined.
  std::vector<std::string> probe_data_paths(const std::map<std::string, std::string>& suspects);
  // Whether `id`, a member of the last formation, was lost or rejoined
  // since it began (it left that group).
  bool gone(const std::string& id) const {
    std::lock_guard<std::mutex> lock(mu_);
    return gone_locked(id) != nullptr;
  }

  // Control thread. Returns false for a message that is not about formation.
  bool on_message(const std::string& id, proto::Envelope::Reader envelope);
  void on_member_gone(const std::string& id);
  // Ends a formation in progress (shutdown).
  void stop();

 private:
  class WatchedStore;
  // form()'s steps, in order: the new epoch (mu_ taken), this rank's own
  // options, the members heard out (whether it ended early), the failure
  // told, or the planes formed for the log.
  uint64_t begin_epoch(const std::vector<std::string>& members, Clock::time_point now);
  GroupOptions own_options(uint64_t epoch, const std::vector<std::string>& members, const std::string& bootstrap,
                           Millis init_timeout) const;
  bool hear_members(const std::vector<std::string>& members, bool own_ok, const FormationEvidence& own,
                    Clock::time_point deadline);
  Status fail_formation(uint64_t epoch, const std::vector<std::string>& members,
                        const std::vector<std::string>& problems);
  std::string planes(const std::vector<std::string>& members) const;
  StatusOr<std::string> announce(uint64_t epoch, const std::vector<std::string>& members, Millis init_timeout);
  // Waits for every member's GroupReady or GroupFailed, until `deadline`, or
  // the end of the evidence window once a member failed.
  void wait_for_members(const std::vector<std::string>& members, Clock::time_point deadline);
  // The formation's first failure (`who` failed: a member's id, or
  // "publisher") opens the collection window.
  void note_failure_locked(const std::string& who);
  // What went wrong, per member, from what they said, this rank's evidence
  // and who is still live; strikes counted. Empty: formed.
  std::vector<std::string> judge(const std::vector<std::string>& members, const FormationEvidence& own,
                                 bool own_failed, bool ended_early);
  // judge()'s steps (verdict.cc), mu_ held; `names`: by group rank. What
  // they find goes in Findings: who is named and why, and the rest.
  struct Findings;
  Verdict attribute_locked(const std::vector<std::string>& names, const FormationEvidence& own, bool own_failed);
  std::map<int, size_t> earlier_accusations_locked(const std::vector<std::string>& names);
  void name_blamed_locked(const Verdict& verdict, const std::vector<std::string>& names, Findings& f);
  void leave_out_locked(const Verdict& verdict, const std::vector<std::string>& names, Findings& f);
  void name_failed_alone_locked(const std::vector<std::string>& members, Findings& f);
  void name_not_ready_locked(const std::vector<std::string>& members, Findings& f);
  // Why formation cannot succeed any more ("" while it still can): a
  // GroupFailed, a lost member, shutdown. Takes mu_.
  std::string doomed(const std::vector<std::string>& members);
  void tell_failed(uint64_t epoch, const std::vector<std::string>& members, const std::string& why);
  // `named`: member → why; `conclusive`: those quarantined at once.
  void count_strikes(const std::vector<std::string>& members, const std::map<std::string, std::string>& named,
                     const std::set<std::string>& conclusive, const std::set<std::string>& data_path);

  // Which members read this host's shared memory this epoch (rank-indexed,
  // data_plane.local), and that plane's bootstrap; written by form() only.
  void choose_local(const std::vector<std::string>& members);
  int store_rank(const std::string& id);
  bool on_shm_plane(int rank) const;

  const Config cfg_;
  const std::string host_identity_;  // this process's (data_plane.local), or empty
  std::vector<bool> local_;
  std::string local_bootstrap_;
  // Each shm reader's own secret, by its rank on the shm plane (index 0
  // unused; empty without an shm plane): written by form() only.
  std::vector<std::string> shm_secrets_;
  control::ControlServer& server_;
  HostedStore store_;
  // Advanced under mu_ with the formation state it belongs to (form());
  // read without it only where an older value is harmless (epoch()).
  std::atomic<uint64_t> epoch_{0};

  mutable std::mutex mu_;  // guards the formation state below
  std::condition_variable cv_;
  bool stopped_ = false;
  std::set<std::string> ready_;
  std::set<std::string> published_;  // members that set a rendezvous key this epoch
  std::map<std::string, std::string> failed_;
  std::map<std::string, FormationEvidence> evidence_;  // from members' GroupFailed, in group ranks
  std::set<std::string> false_ready_;                   // said GroupReady without publishing an address
  std::set<std::string> failed_alone_;                  // sent GroupFailed without evidence
  std::string first_failed_;                            // whose failure opened the window
  std::set<std::string> connected_;                     // failed after every pair of its mesh connected
  Clock::time_point first_failure_{};                   // the formation's first failure (collection window)
  bool have_failure_ = false;
  std::map<std::string, int> assigned_rank_;
  // Mixed groups: a member's rank in the backend's plane (what its
  // rendezvous keys carry), -1 for one on the shm plane; empty otherwise.
  std::map<std::string, int> plane_rank_;
  struct Strikes {
    int count = 0;
    std::string reason;
    Clock::time_point last;   // the last failure
    Clock::time_point until;  // quarantined until (count >= 2)
    bool data_path = false;   // the last failure was its data path's: a passing link check lets it out early
    bool burned = false;      // a check let it out early once: until it forms, it serves its backoffs
  };
  // `data_path`: the failure was the member's data path (unreachable, its
  // address missed, not ready): a passing link check may end it early.
  void strike_locked(const std::string& id, const std::string& reason, int at_least, Clock::time_point now,
                     bool data_path = false);
  // Link checks (link_check.h): whether `id` is checked before it is tried
  // again (a live member on the Gloo plane, not this host's shm plane), and
  // who needs a check now. mu_ held / not held.
  bool checked_locked(const std::string& id) const;
  std::vector<std::string> due_checks();
  // Starts the link checks at the first quarantine (Gloo plane), or at the
  // first probe (`now`); mu_ not held.
  void ensure_checks(bool now = false);
  // A member whose connection was lost meanwhile, or that rejoined (a
  // restart, a new connection: it left the group): handled (and named) as
  // such; no evidence of a member breaking formation, never struck.
  static constexpr const char* kLostDuringFormation = "lost during group formation";
  static constexpr const char* kRejoinedDuringFormation = "rejoined during group formation (it left the group)";
  static constexpr const char* kFalseReady = "said GroupReady without having published its rendezvous address";
  // kLostDuringFormation or kRejoinedDuringFormation when `id` left the
  // formation so; nullptr otherwise. mu_ held.
  const char* gone_locked(const std::string& id) const;
  std::map<std::string, Strikes> strikes_;  // consecutive failed formations per worker id
  std::vector<std::string> last_blamed_;
  std::vector<std::string> last_conclusive_;
  // Left out of formations, not struck, until `until` (attribution step 3).
  struct LeftOut {
    std::string reason;
    Clock::time_point until;
  };
  std::map<std::string, LeftOut> left_out_;
  uint64_t turn_ = 0;  // which side of a tied partition is served next
  // accused id -> accuser id -> until: the lone accusations of recent
  // formations (Verdict::lone), weighed with the next ones' (`earlier`)
  // for a quarantine_backoff.
  std::map<std::string, std::map<std::string, Clock::time_point>> accused_by_;
  // Started with the first quarantine (Gloo plane); null before, or where
  // it could not start (then backoffs alone decide, as without it).
  std::shared_ptr<LinkCheckHost> checks_;  // shared: a probe (update thread) keeps it through stop()
  bool checks_tried_ = false;
};

}  // namespace paramcast::group
