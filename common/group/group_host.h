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
// Formation fails fast: the first GroupFailed (or a member lost meanwhile)
// ends it at once, this rank's own rendezvous included, and every member is
// told with a GroupFailed of the epoch so that none waits out init_timeout.
// Quarantine follows the identity, not the connection: a member named by two
// failed formations in a row is left out of formations (excluded()) for
// publisher.quarantine_backoff, doubled for each further failure (at most
// 16x), then tried again; restarting or rejoining does not reset it. A
// formation it is ready in clears its strikes, as do 32 backoffs without a
// failure. A formation that names every member strikes nobody: its evidence
// cannot tell which one is at fault.
//
// The rendezvous store is served here too: the owner routes StoreSet,
// StoreGet, GroupReady and GroupFailed from the control thread to
// on_message(), and member losses to on_member_gone().
//
// Threads: form() on the caller's thread (one at a time); on_message() and
// on_member_gone() on the control thread; the rest from any thread.
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
#include "common/group/rendezvous_store.h"

namespace paramcast::group {

class GroupHost {
 public:
  GroupHost(const Config& config, control::ControlServer& server);

  // `cap`: formation ends by then at the latest (the update's deadline),
  // and by data_plane.init_timeout from now.
  StatusOr<std::shared_ptr<Communicator>> form(const std::vector<std::string>& members,
                                               Clock::time_point cap = Clock::time_point::max());
  uint64_t epoch() const { return epoch_; }

  // Members in quarantine now, each with why and for how much longer.
  std::map<std::string, std::string> excluded(Clock::time_point now = Clock::now()) const;
  // The members the last failed formation named (empty after a success).
  std::vector<std::string> last_blamed() const;
  // Quarantines `id` at once (a member that broke the start-up formation).
  void quarantine(const std::string& id, const std::string& reason);

  // Control thread. Returns false for a message that is not about formation.
  bool on_message(const std::string& id, proto::Envelope::Reader envelope);
  void on_member_gone(const std::string& id);
  // Ends a formation in progress (shutdown).
  void stop();

 private:
  class WatchedStore;
  StatusOr<std::string> announce(uint64_t epoch, const std::vector<std::string>& members);
  std::vector<std::string> wait_for_members(const std::vector<std::string>& members, Clock::time_point deadline);
  // Why formation cannot succeed any more ("" while it still can): a
  // GroupFailed, a lost member, shutdown. Takes mu_.
  std::string doomed(const std::vector<std::string>& members);
  void tell_failed(uint64_t epoch, const std::vector<std::string>& members, const std::string& why);
  void count_strikes(const std::vector<std::string>& members, const std::vector<std::string>& problems);

  // Which members read this host's shared memory this epoch (rank-indexed,
  // data_plane.local), and that plane's bootstrap; written by form() only.
  void choose_local(const std::vector<std::string>& members);
  int store_rank(const std::string& id);

  const Config cfg_;
  const std::string host_identity_;  // this process's (data_plane.local), or empty
  std::vector<bool> local_;
  std::string local_bootstrap_;
  control::ControlServer& server_;
  HostedStore store_;
  std::atomic<uint64_t> epoch_{0};

  mutable std::mutex mu_;  // guards the formation state below
  std::condition_variable cv_;
  bool stopped_ = false;
  std::set<std::string> ready_;
  std::set<std::string> published_;  // members that set a rendezvous key this epoch
  std::map<std::string, std::string> failed_;
  std::map<std::string, int> assigned_rank_;
  // Mixed groups: a member's rank in the backend's plane (what its
  // rendezvous keys carry), -1 for one on the shm plane; empty otherwise.
  std::map<std::string, int> plane_rank_;
  struct Strikes {
    int count = 0;
    std::string reason;
    Clock::time_point last;   // the last failure
    Clock::time_point until;  // quarantined until (count >= 2)
  };
  void strike_locked(const std::string& id, const std::string& reason, int at_least, Clock::time_point now);
  std::map<std::string, Strikes> strikes_;  // consecutive failed formations per worker id
  std::vector<std::string> last_blamed_;
};

}  // namespace paramcast::group
