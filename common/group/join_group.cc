#include "common/group/join_group.h"

namespace paramcast::group {

void fill_join_group(proto::JoinGroup::Builder j, const GroupOptions& o, const std::vector<std::string>& members) {
  j.setRank(static_cast<uint32_t>(o.rank));
  j.setWorldSize(static_cast<uint32_t>(o.world_size));
  j.setBackend(static_cast<proto::Backend>(backend_wire(o.backend)));
  j.setBootstrap(kj::arrayPtr(reinterpret_cast<const kj::byte*>(o.bootstrap.data()), o.bootstrap.size()));
  auto list = j.initMembers(static_cast<unsigned>(members.size()));
  for (size_t k = 0; k < members.size(); ++k) list.set(static_cast<unsigned>(k), members[k]);
  j.setInitTimeoutMs(static_cast<uint32_t>(o.init_timeout.count()));
  j.setOpTimeoutMs(static_cast<uint32_t>(o.op_timeout.count()));
  j.setStallTimeoutMs(static_cast<uint32_t>(o.stall_timeout.count()));
  j.setShedFloor(o.shed_floor);
  j.setShedWindowMs(static_cast<uint32_t>(o.shed_window.count()));
  if (!o.local.empty()) {
    auto local = j.initLocal(static_cast<unsigned>(o.local.size()));
    for (size_t r = 0; r < o.local.size(); ++r) local.set(static_cast<unsigned>(r), o.local[r]);
    j.setLocalBootstrap(
        kj::arrayPtr(reinterpret_cast<const kj::byte*>(o.local_bootstrap.data()), o.local_bootstrap.size()));
  }
}

GroupOptions group_options_from(proto::JoinGroup::Reader j, uint64_t epoch, Device device,
                                const DataPlaneOptions& data_plane) {
  GroupOptions o;
  o.epoch = epoch;
  o.rank = static_cast<int>(j.getRank());
  o.world_size = static_cast<int>(j.getWorldSize());
  o.backend = backend_from_wire(static_cast<int>(j.getBackend()));
  o.bootstrap.assign(reinterpret_cast<const char*>(j.getBootstrap().begin()), j.getBootstrap().size());
  o.device = device;
  o.init_timeout = std::chrono::milliseconds(j.getInitTimeoutMs());
  o.op_timeout = std::chrono::milliseconds(j.getOpTimeoutMs());
  o.stall_timeout = j.getStallTimeoutMs() ? std::chrono::milliseconds(j.getStallTimeoutMs()) : data_plane.stall_timeout;
  o.shed_floor = j.getShedFloor();
  if (j.getShedWindowMs() > 0) o.shed_window = std::chrono::milliseconds(j.getShedWindowMs());
  // Names for messages only; bytes from the network, so checked and bounded.
  for (const auto& m : j.getMembers()) {
    if (o.members.size() >= static_cast<size_t>(o.world_size)) break;
    const std::string id(m.cStr(), m.size());
    o.members.push_back(id == "publisher" || valid_worker_id(id) ? id : "?");
  }
  o.gloo_hostname = data_plane.gloo_hostname;
  o.gloo_interface = data_plane.gloo_interface;
  // One flag per rank, or none (a list of another length is ignored: the
  // formation then fails at init_timeout rather than mixing layouts).
  if (j.getLocal().size() == static_cast<unsigned>(o.world_size) && o.world_size > 0) {
    for (bool l : j.getLocal()) o.local.push_back(l);
    o.local_bootstrap.assign(reinterpret_cast<const char*>(j.getLocalBootstrap().begin()),
                             j.getLocalBootstrap().size());
  }
  return o;
}

}  // namespace paramcast::group
