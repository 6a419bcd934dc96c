// GroupMember: group formation on a subscriber's side.
//
// The control thread turns a JoinGroup into GroupOptions (join_group.h); the
// data thread calls join(), which creates this rank's communicator through a
// RemoteStore over the control channel and reports GroupReady or GroupFailed
// for that epoch. StoreValue answers and membership changes arrive from the
// control thread.
//
// Threads: join() on the data thread; the on_* methods on the control thread.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "common/control/control_client.h"
#include "common/data/communicator.h"
#include "common/data/reaper.h"
#include "common/group/rendezvous_store.h"

namespace paramcast::group {

class GroupMember {
 public:
  GroupMember(std::string worker_id, control::ControlClient& client);

  // Creates the communicator of `options.epoch` and says GroupReady, or says
  // GroupFailed with the reason and returns it. The communicator is released
  // on this member's reaper thread when its last owner drops it.
  StatusOr<std::shared_ptr<Communicator>> join(const GroupOptions& options);

  void on_store_value(uint64_t request_id, std::string value) { store_.deliver(request_id, std::move(value)); }
  // Welcomed (again): a new publisher counts its epochs from 1 again.
  void on_joined() {
    abandoned_ = 0;
    store_.reset();
  }
  void on_unavailable(const std::string& why) { store_.fail(why); }
  // Control thread: formations up to `epoch` are over (the publisher said
  // GroupFailed, or a newer JoinGroup arrived): a join() of one of them ends
  // now instead of waiting out init_timeout.
  void abandon_formations(uint64_t epoch, const std::string& why);

 private:
  Reaper reaper_;  // declared first: outlives the store and the client calls
  const std::string id_;
  control::ControlClient& client_;
  std::atomic<uint64_t> epoch_{0};  // the epoch being joined, stamped on store messages
  std::atomic<uint64_t> abandoned_{0};  // formations up to this epoch are over
  std::atomic<bool> store_failed_by_abandon_{false};
  RemoteStore store_;
};

}  // namespace paramcast::group
