#include "common/group/group_member.h"

#include "common/control/messages.h"
#include "common/log.h"

namespace paramcast::group {

GroupMember::GroupMember(std::string worker_id, control::ControlClient& client)
    : id_(std::move(worker_id)), client_(client), store_([this](const RemoteStore::Request& r) {
        client_.send(control::make_message(epoch_, client_.incarnation(), [&](auto b) {
          if (r.is_get) {
            auto m = b.initStoreGet();
            m.setRequestId(r.request_id);
            m.setKey(r.key);
          } else {
            auto m = b.initStoreSet();
            m.setKey(r.key);
            m.setValue(kj::arrayPtr(reinterpret_cast<const kj::byte*>(r.value.data()), r.value.size()));
          }
        }));
      }) {}

void GroupMember::abandon_formations(uint64_t epoch, const std::string& why) {
  uint64_t seen = abandoned_.load();
  while (seen < epoch && !abandoned_.compare_exchange_weak(seen, epoch)) {
  }
  if (epoch_.load() != 0 && epoch_.load() <= epoch) {
    store_failed_by_abandon_ = true;
    store_.fail(why);
  }
}

StatusOr<std::shared_ptr<Communicator>> GroupMember::join(const GroupOptions& options) {
  if (store_failed_by_abandon_.exchange(false)) store_.reset();  // that formation is over; this one is new
  epoch_ = options.epoch;
  StatusOr<std::unique_ptr<Communicator>> comm =
      options.epoch <= abandoned_.load()
          ? StatusOr<std::unique_ptr<Communicator>>(unavailable("group epoch " + std::to_string(options.epoch) +
                                                                " was abandoned before this rank joined it"))
          : create_communicator(options, store_);
  const auto rank = static_cast<uint32_t>(options.rank);
  if (!comm.ok()) {
    PC_WARN(id_ << ": group epoch " << options.epoch << " failed: " << comm.status().message());
    client_.send(control::make_message(options.epoch, client_.incarnation(), [&](auto b) {
      auto f = b.initGroupFailed();
      f.setRank(rank);
      f.setReason(comm.status().to_string());
    }));
    return comm.status();
  }
  PC_INFO(id_ << ": rank " << options.rank << " of " << options.world_size << " in group epoch " << options.epoch);
  client_.send(control::make_message(options.epoch, client_.incarnation(),
                                     [&](auto b) { b.initGroupReady().setRank(rank); }));
  return reaper_.adopt(std::move(comm.value()));
}

}  // namespace paramcast::group
