// GroupMember: group formation on a subscriber's side.
//
// The control thread turns a JoinGroup into GroupOptions (join_group.h); the
// data thread calls join(), which creates this rank's communicator through a
// RemoteStore over the control channel and reports GroupReady or GroupFailed
// for that epoch. StoreValue answers and membership changes arrive from the
// control thread.
//
// A formation can be given up while this rank is inside the backend's
// connect (bounded by init_timeout, data/gloo/mesh.h; NCCL's init likewise).
// So each attempt runs on a thread of its own: join() returns as soon as the
// attempt finishes or its formation is abandoned (the publisher said
// GroupFailed, a newer JoinGroup arrived, the publisher was lost, the
// subscriber stops), and an abandoned attempt ends on its own thread, which
// also destroys what it built. A failed attempt's GroupFailed carries its
// evidence: the ranks it could not reach (FormationEvidence).
//
// Test hook: PARAMCAST_FAULT_BAD_ADDRESS=1 makes this member publish its
// Gloo address records with port 1, where nothing listens (a member with a
// bad address, for process tests of attribution); the store traffic is real.
// PARAMCAST_FAULT_FALSE_READY=1 makes it say GroupReady at once, without
// publishing an address or creating a communicator (a member that lies).
// PARAMCAST_FAULT_ACCUSE=worker-1,... makes it, once its mesh connected,
// say GroupFailed claiming it could not reach those members of the group
// (a member that frames others; peers and publisher reached them).
// PARAMCAST_FAULT_FAIL_FIRST_FORMATION=1 makes its first formation fail
// without evidence once its mesh connected (the echo of another member's
// failure; with ACCUSE, a framer whose first formation failed for real, and
// that accuses from the second on); PARAMCAST_FAULT_REPORT_AFTER_MS=N sends each GroupReady or
// GroupFailed N ms late (a slow control path). A formation that ACCUSE or
// FAIL_FIRST_FORMATION says failed keeps its communicator open until the
// next join(): its peers' meshes connect, so only its word speaks.
//
// Threads: join() on the data thread; the on_* methods on the control thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/control/control_client.h"
#include "common/data/communicator.h"
#include "common/data/reaper.h"
#include "common/group/rendezvous_store.h"

namespace paramcast::group {

class GroupMember {
 public:
  GroupMember(std::string worker_id, control::ControlClient& client);
  ~GroupMember();

  // Creates the communicator of `options.epoch` and says GroupReady, or says
  // GroupFailed with the reason and returns it. The communicator is released
  // on this member's reaper thread when its last owner drops it.
  StatusOr<std::shared_ptr<Communicator>> join(const GroupOptions& options);

  void on_store_value(uint64_t request_id, std::string value) { store_->deliver(request_id, std::move(value)); }
  // Welcomed (again): a new publisher counts its epochs from 1 again.
  void on_joined();
  // The publisher is lost, or the subscriber stops: the attempt in progress ends.
  void on_unavailable(const std::string& why);
  // Control thread: formations up to `epoch` are over (the publisher said
  // GroupFailed, or a newer JoinGroup arrived): a join() of one of them ends
  // now instead of waiting out init_timeout.
  void abandon_formations(uint64_t epoch, const std::string& why);

 private:
  struct Link;     // what the store's messages go through; outlives this object
  struct Attempt;  // one formation attempt, shared with its thread
  void end_attempt(uint64_t up_to_epoch, const std::string& why);

  Reaper reaper_;  // declared first: outlives the store and the client calls
  const std::string id_;
  bool false_ready_ = false;  // PARAMCAST_FAULT_FALSE_READY
  std::vector<std::string> accuse_;  // PARAMCAST_FAULT_ACCUSE
  bool fail_first_ = false;          // PARAMCAST_FAULT_FAIL_FIRST_FORMATION
  Millis report_after_{0};           // PARAMCAST_FAULT_REPORT_AFTER_MS
  std::shared_ptr<Communicator> held_by_hook_;  // data thread: a formation ACCUSE or FAIL_FIRST said failed
  control::ControlClient& client_;
  std::shared_ptr<Link> link_;
  std::shared_ptr<RemoteStore> store_;
  std::atomic<uint64_t> abandoned_{0};  // formations up to this epoch are over
  std::atomic<bool> store_failed_by_abandon_{false};
  std::mutex mu_;  // guards attempt_, and join()'s switch of epoch against abandon_formations()
  std::shared_ptr<Attempt> attempt_;  // the one join() waits for
};

}  // namespace paramcast::group
