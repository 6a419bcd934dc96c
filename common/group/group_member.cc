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

StatusOr<std::shared_ptr<Communicator>> GroupMember::join(const GroupOptions& options) {
  epoch_ = options.epoch;
  auto comm = create_communicator(options, store_);
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
