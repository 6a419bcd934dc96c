#include "common/group/group_host.h"

#include "common/control/messages.h"
#include "common/group/join_group.h"
#include "common/log.h"

namespace paramcast::group {

GroupHost::GroupHost(const Config& config, control::ControlServer& server)
    : cfg_(config),
      server_(server),
      store_([this](const std::string& peer, uint64_t request_id, const std::string& key, const std::string& value) {
        server_.send(peer, control::make_message(epoch_, server_.incarnation(), [&](auto b) {
          auto v = b.initStoreValue();
          v.setRequestId(request_id);
          v.setKey(key);
          v.setValue(kj::arrayPtr(reinterpret_cast<const kj::byte*>(value.data()), value.size()));
        }));
      }) {}

StatusOr<std::shared_ptr<Communicator>> GroupHost::form(const std::vector<std::string>& members) {
  if (members.empty()) return unavailable("no live subscriber to form a group with");
  const uint64_t epoch = ++epoch_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ready_.clear();
    failed_.clear();
  }
  store_.begin_epoch(epoch);  // keys of earlier epochs are dropped, and members write only this one's
  server_.set_epoch(epoch);
  server_.assign_ranks(members);
  auto bootstrap = announce(epoch, members);
  if (!bootstrap.ok()) return bootstrap.status();
  GroupOptions go;
  go.epoch = epoch;
  go.rank = 0;
  go.world_size = static_cast<int>(members.size()) + 1;
  go.backend = cfg_.data_plane.backend;
  go.bootstrap = *bootstrap;
  go.device = cfg_.publisher.device;
  go.init_timeout = cfg_.data_plane.init_timeout;
  go.op_timeout = cfg_.data_plane.timeout;
  go.gloo_hostname = cfg_.data_plane.gloo_hostname;
  go.gloo_interface = cfg_.data_plane.gloo_interface;
  auto comm = create_communicator(go, store_);
  std::vector<std::string> problems = wait_for_members(members);
  store_.end_epoch();  // formed or failed: no rank reads the addresses again
  if (!comm.ok()) problems.push_back("publisher: " + comm.status().message());
  if (!problems.empty()) {
    std::string msg = "group of epoch " + std::to_string(epoch) + " failed to form: ";
    for (size_t i = 0; i < problems.size(); ++i) msg += (i ? "; " : "") + problems[i];
    return unavailable(msg);
  }
  PC_INFO("publisher: group epoch " << epoch << " formed: publisher + " << members.size() << " subscribers ("
                                    << backend_name(cfg_.data_plane.backend) << ")");
  return std::shared_ptr<Communicator>(std::move(comm.value()));
}

// Mints the bootstrap and sends every member its JoinGroup.
StatusOr<std::string> GroupHost::announce(uint64_t epoch, const std::vector<std::string>& members) {
  auto bootstrap = mint_bootstrap(cfg_.data_plane.backend, epoch);
  if (!bootstrap.ok()) return bootstrap.status();
  std::vector<std::string> names = {"publisher"};
  names.insert(names.end(), members.begin(), members.end());
  GroupOptions go;
  go.world_size = static_cast<int>(names.size());
  go.backend = cfg_.data_plane.backend;
  go.bootstrap = *bootstrap;
  go.init_timeout = cfg_.data_plane.init_timeout;
  go.op_timeout = cfg_.data_plane.timeout;
  for (size_t i = 0; i < members.size(); ++i) {
    go.rank = static_cast<int>(i + 1);
    server_.send(members[i], control::make_message(epoch, server_.incarnation(), [&](auto b) {
                   fill_join_group(b.initJoinGroup(), go, names);
                 }));
  }
  return bootstrap;
}

// Waits for GroupReady from every member; returns what went wrong, per member.
std::vector<std::string> GroupHost::wait_for_members(const std::vector<std::string>& members) {
  const auto deadline = Clock::now() + cfg_.data_plane.init_timeout;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, deadline, [&] {
    if (!failed_.empty() || stopped_) return true;
    bool pending = false;
    for (const auto& id : members) {
      if (ready_.count(id)) continue;
      if (!server_.is_live(id)) return true;  // it will never be ready: fail now
      pending = true;
    }
    return !pending;
  });
  std::vector<std::string> problems;
  for (const auto& id : members) {
    if (failed_.count(id)) problems.push_back(id + ": " + failed_[id]);
    else if (!server_.is_live(id)) problems.push_back(id + ": lost during group formation");
    else if (!ready_.count(id)) problems.push_back(id + ": not ready within init_timeout");
  }
  if (stopped_ && problems.empty()) problems.push_back("publisher shutting down");
  return problems;
}

bool GroupHost::on_message(const std::string& id, proto::Envelope::Reader env) {
  using B = proto::Envelope::Body;
  auto body = env.getBody();
  const bool current = env.getEpoch() == epoch_;
  switch (body.which()) {
    case B::GROUP_READY: {
      std::lock_guard<std::mutex> lock(mu_);
      if (current) ready_.insert(id);
      break;
    }
    case B::GROUP_FAILED: {
      std::lock_guard<std::mutex> lock(mu_);
      if (current) failed_[id] = body.getGroupFailed().getReason().cStr();
      break;
    }
    case B::STORE_SET: {
      auto s = body.getStoreSet();
      const auto m = server_.member(id);
      Status st = store_.remote_set(id, m ? m->rank : -1, s.getKey().cStr(),
                                    std::string(reinterpret_cast<const char*>(s.getValue().begin()), s.getValue().size()));
      if (!st.ok()) server_.note_dropped(id, st.message());
      return true;
    }
    case B::STORE_GET: {
      const auto m = server_.member(id);
      Status st = store_.remote_get(id, m ? m->rank : -1, body.getStoreGet().getRequestId(),
                                    body.getStoreGet().getKey().cStr());
      if (!st.ok()) server_.note_dropped(id, st.message());
      return true;
    }
    default:
      return false;
  }
  cv_.notify_all();
  return true;
}

void GroupHost::on_member_gone(const std::string&) {
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
}

void GroupHost::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
  }
  cv_.notify_all();
}

}  // namespace paramcast::group
