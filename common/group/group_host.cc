#include "common/group/group_host.h"

#include "common/data/shm/segment.h"

#include "common/control/messages.h"
#include "common/data/shm/host_identity.h"
#include "common/group/attribution.h"
#include "common/group/join_group.h"
#include "common/log.h"
#include "common/units.h"

#include <algorithm>

namespace paramcast::group {

namespace {
// After a formation's first failure, how long the other ranks' reports (and
// this rank's own connects) still count: the members that failed with the
// same peer report within milliseconds of each other.
constexpr Millis kEvidenceWindow(1500);
// This rank's own part failing this long before the deadline failed early
// (not a backend's own timeout at init_timeout).
constexpr Millis kOwnDeadlineSlack(200);
}  // namespace

GroupHost::GroupHost(const Config& config, control::ControlServer& server)
    : cfg_(config),
      host_identity_(config.data_plane.local && config.data_plane.backend == Backend::kGloo &&
                             !config.publisher.device.is_cuda()
                         ? shm_backend::host_identity()
                         : ""),
      server_(server),
      store_([this](const std::string& peer, uint64_t request_id, const std::string& key, const std::string& value) {
        server_.send(peer, control::make_message(epoch_, server_.incarnation(), [&](auto b) {
          auto v = b.initStoreValue();
          v.setRequestId(request_id);
          v.setKey(key);
          v.setValue(kj::arrayPtr(reinterpret_cast<const kj::byte*>(value.data()), value.size()));
        }));
      }) {}

// Rank 0's view of the hosted store while a group forms: a get waits in short
// slices and ends as soon as the formation is doomed, so that a member's
// GroupFailed does not leave this rank waiting out init_timeout for a key that
// member will never set.
class GroupHost::WatchedStore : public Store {
 public:
  WatchedStore(Store& inner, std::function<std::string()> doomed) : inner_(inner), doomed_(std::move(doomed)) {}
  Status set(const std::string& key, const std::string& value) override { return inner_.set(key, value); }
  std::string cancelled() override { return doomed_(); }
  StatusOr<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      auto value = inner_.get(key, std::clamp(left, std::chrono::milliseconds(1), std::chrono::milliseconds(50)));
      if (value.ok() || value.status().code() != Code::kTimeout) return value;
      if (std::string why = doomed_(); !why.empty()) return unavailable("group formation ended: " + why);
      if (Clock::now() >= deadline)
        return timeout_error("rendezvous key '" + key + "' not set within " + std::to_string(timeout.count()) + "ms");
    }
  }

 private:
  Store& inner_;
  const std::function<std::string()> doomed_;
};

StatusOr<std::shared_ptr<Communicator>> GroupHost::form(const std::vector<std::string>& members,
                                                         Clock::time_point cap) {
  if (members.empty()) return unavailable("no live subscriber to form a group with");
  const auto now = Clock::now();
  const auto deadline = std::min(now + cfg_.data_plane.init_timeout, cap);
  if (deadline <= now) return timeout_error("no time left before update_timeout to form a group");
  const auto init_timeout = std::chrono::duration_cast<Millis>(deadline - now);
  const uint64_t epoch = begin_epoch(members, now);
  store_.begin_epoch(epoch);  // keys of earlier epochs are dropped, and members write only this one's
  server_.set_epoch(epoch);
  server_.assign_ranks(members);
  choose_local(members);
  // The members' connects end a little before this rank's (their reports
  // must arrive while it still listens): the remaining time, less a margin.
  const auto margin = std::min<Millis>(Millis(1000), init_timeout / 10);
  auto bootstrap = announce(epoch, members, std::max(Millis(1), init_timeout - margin));
  if (!bootstrap.ok()) return bootstrap.status();
  WatchedStore store(store_, [&] { return doomed(members); });
  FormationEvidence own;
  auto comm = create_communicator(own_options(epoch, members, *bootstrap, init_timeout), store, &own);
  const bool ended_early = hear_members(members, comm.ok(), own, deadline);
  if (!comm.ok()) PC_INFO("publisher: its own part of group epoch " << epoch << ": " << comm.status().message());
  std::vector<std::string> problems = judge(members, own, !comm.ok(), ended_early);
  if (!comm.ok() && problems.empty()) problems.push_back("publisher: " + comm.status().message());
  if (!problems.empty()) return fail_formation(epoch, members, problems);
  PC_INFO("publisher: group epoch " << epoch << " formed: publisher + " << members.size() << " subscribers ("
                                    << planes(members) << ")");
  return std::shared_ptr<Communicator>(std::move(comm.value()));
}

// The new epoch and its empty state in one step under mu_: a report of the
// last epoch (a member's echo of its end, which often crosses this
// formation's start) is either taken before it, and cleared, or weighed
// after it as an old epoch's, and dropped (on_message).
uint64_t GroupHost::begin_epoch(const std::vector<std::string>& members, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t epoch = ++epoch_;
  ready_.clear();
  published_.clear();
  failed_.clear();
  evidence_.clear();
  false_ready_.clear();
  failed_alone_.clear();
  connected_.clear();
  first_failed_.clear();
  have_failure_ = false;
  assigned_rank_.clear();
  for (size_t i = 0; i < members.size(); ++i) assigned_rank_[members[i]] = static_cast<int>(i + 1);
  // A member tried before its quarantine ended (a passing link check let
  // it out) has had its early try, whatever this formation does.
  for (const auto& id : members)
    if (auto it = strikes_.find(id); it != strikes_.end() && it->second.count >= 2 && it->second.until > now)
      it->second.burned = true;
  return epoch;
}

// This rank's own options: rank 0 of the publisher and `members`.
GroupOptions GroupHost::own_options(uint64_t epoch, const std::vector<std::string>& members,
                                    const std::string& bootstrap, Millis init_timeout) const {
  GroupOptions go;
  go.local = local_;
  go.local_bootstrap = local_bootstrap_;
  go.shm_rank_secrets = shm_secrets_;  // the root checks each reader's
  go.epoch = epoch;
  go.rank = 0;
  go.world_size = static_cast<int>(members.size()) + 1;
  go.backend = cfg_.data_plane.backend;
  go.bootstrap = bootstrap;
  go.device = cfg_.publisher.device;
  go.init_timeout = std::max(init_timeout, Millis(1));
  go.op_timeout = cfg_.publisher.update_timeout;  // a backstop: no broadcast outlives its update
  go.stall_timeout = cfg_.data_plane.stall_timeout;
  if (cfg_.publisher.on_slow_member == SlowMemberPolicy::kShed) {
    go.shed_floor = cfg_.publisher.slow_member_floor;
    go.shed_window = cfg_.publisher.slow_member_window;
  }
  go.members = {"publisher"};
  go.members.insert(go.members.end(), members.begin(), members.end());
  go.gloo_hostname = cfg_.data_plane.gloo_hostname;
  go.gloo_interface = cfg_.data_plane.gloo_interface;
  go.shm_slot_bytes = std::min<uint64_t>(cfg_.data_plane.bucket_bytes, 64ull << 20);
  return go;
}

// This rank's own part is done (`own_ok`: its communicator formed): the
// members' word, and the store closed. Returns whether the formation ended
// early (on evidence, or shutdown).
bool GroupHost::hear_members(const std::vector<std::string>& members, bool own_ok, const FormationEvidence& own,
                             Clock::time_point deadline) {
  // This rank's own part failed before the deadline: on evidence, or as the
  // echo of a member that gave up and closed its pair (Gloo names no peer
  // then). Either way a failure like a member's: the members' word for the
  // rest of the window, and its own word covers every peer it did not name.
  // One that failed at the deadline on its own (NCCL, shm timing out) leaves
  // the members not ready to be named.
  const bool own_early = !own_ok && (!own.empty() || Clock::now() + kOwnDeadlineSlack < deadline);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (own_early) note_failure_locked("publisher");
  }
  // Formed, or failed early: every member's word (within the window once
  // anything failed). Failed at the deadline: what they said by now.
  wait_for_members(members, own_ok || own_early ? deadline : Clock::now());
  store_.end_epoch();  // formed or failed: no rank reads the addresses again
  std::lock_guard<std::mutex> lock(mu_);
  // This rank's own failure ended it early only on evidence (its connects,
  // or another rank's GroupFailed); a backend that timed out on its own
  // (NCCL, shm) leaves the members not ready to be named.
  return !failed_.empty() || stopped_ || own_early;
}

// Every member told, and the error naming what went wrong.
Status GroupHost::fail_formation(uint64_t epoch, const std::vector<std::string>& members,
                                 const std::vector<std::string>& problems) {
  std::string msg = "group of epoch " + std::to_string(epoch) + " failed to form: ";
  for (size_t i = 0; i < problems.size(); ++i) msg += (i ? "; " : "") + problems[i];
  tell_failed(epoch, members, msg);
  return unavailable(msg);
}

// The group's data planes, for the log: the backend's, and in a mixed group
// who reads this host's shared memory.
std::string GroupHost::planes(const std::vector<std::string>& members) const {
  std::string planes = backend_name(cfg_.data_plane.backend);
  if (local_.empty()) return planes;
  std::string shm;
  for (size_t i = 0; i < members.size(); ++i)
    if (local_[i + 1]) shm += (shm.empty() ? "" : ", ") + members[i];
  return planes + "; shm: " + shm;
}

std::string GroupHost::doomed(const std::vector<std::string>& members) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_) return "publisher shutting down";
  // A failure ends it once the window for the other ranks' reports passed
  // (wait_for_members ends the wait sooner when every member answered).
  if (have_failure_ && Clock::now() >= first_failure_ + kEvidenceWindow)
    for (const auto& [id, why] : failed_) return id + ": " + why;
  for (const auto& id : members)
    if (const char* why = gone_locked(id)) return id + ": " + why;
  return "";
}

const char* GroupHost::gone_locked(const std::string& id) const {
  const auto m = server_.member(id);
  if (!m || m->lost) return kLostDuringFormation;
  const auto rank = assigned_rank_.find(id);
  if (rank != assigned_rank_.end() && m->rank != rank->second) return kRejoinedDuringFormation;
  return nullptr;
}

// Every live member of a failed formation stops joining it now.
void GroupHost::tell_failed(uint64_t epoch, const std::vector<std::string>& members, const std::string& why) {
  for (const auto& id : members) {
    if (!server_.is_live(id)) continue;
    server_.send(id, control::make_message(epoch, server_.incarnation(), [&](auto b) {
                   auto f = b.initGroupFailed();
                   f.setRank(0);
                   f.setReason(why.substr(0, 4096));
                 }));
  }
}

// Whether group rank `rank` reads the publisher's shared memory this epoch.
bool GroupHost::on_shm_plane(int rank) const {
  if (cfg_.data_plane.backend == Backend::kShm) return true;
  return rank >= 0 && static_cast<size_t>(rank) < local_.size() && local_[static_cast<size_t>(rank)];
}

// The rank a member's rendezvous keys carry: its group rank, or in a mixed
// group its rank in the backend's plane.
int GroupHost::store_rank(const std::string& id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plane_rank_.find(id);
    if (it != plane_rank_.end()) return it->second;
  }
  const auto m = server_.member(id);
  return m ? m->rank : -1;
}

namespace {
// `n` fresh secrets, one per rank of an shm plane (index 0, the root's, unused),
// cut from freshly minted shm bootstraps (their last 32 bytes).
StatusOr<std::vector<std::string>> rank_secrets(size_t n, uint64_t epoch) {
  std::vector<std::string> out(n);
  for (size_t r = 1; r < n; ++r) {
    auto b = mint_bootstrap(Backend::kShm, epoch);
    if (!b.ok()) return b.status();
    auto parsed = shm_backend::Bootstrap::parse(*b);
    if (!parsed.ok()) return parsed.status();
    out[r] = parsed->secret;
  }
  return out;
}
}  // namespace

void GroupHost::choose_local(const std::vector<std::string>& members) {
  local_.clear();
  local_bootstrap_.clear();
  shm_secrets_.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    plane_rank_.clear();
  }
  if (host_identity_.empty()) return;
  std::vector<bool> local(members.size() + 1, false);
  local[0] = true;
  bool any = false;
  for (size_t i = 0; i < members.size(); ++i) {
    auto m = server_.member(members[i]);
    local[i + 1] = m && m->host_identity == host_identity_;
    any = any || local[i + 1];
  }
  if (!any) return;
  auto b = mint_bootstrap(Backend::kShm, epoch_);
  if (!b.ok()) {
    PC_WARN("publisher: no shm plane this epoch (every member over " << backend_name(cfg_.data_plane.backend)
                                                                     << "): " << b.status().message());
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    int next = 1;
    for (size_t i = 0; i < members.size(); ++i) plane_rank_[members[i]] = local[i + 1] ? -1 : next++;
  }
  // Each reader its own secret (by its rank on the shm plane: the local
  // members in rank order after the root).
  size_t readers = 0;
  for (size_t i = 1; i < local.size(); ++i) readers += local[i];
  auto secrets = rank_secrets(readers + 1, epoch_);
  if (!secrets.ok()) {
    PC_WARN("publisher: no shm plane this epoch: " << secrets.status().message());
    std::lock_guard<std::mutex> lock(mu_);
    plane_rank_.clear();
    return;
  }
  local_ = std::move(local);
  local_bootstrap_ = std::move(*b);
  shm_secrets_ = std::move(*secrets);
}

// Mints the bootstrap and sends every member its JoinGroup.
StatusOr<std::string> GroupHost::announce(uint64_t epoch, const std::vector<std::string>& members,
                                          Millis init_timeout) {
  auto bootstrap = mint_bootstrap(cfg_.data_plane.backend, epoch);
  if (!bootstrap.ok()) return bootstrap.status();
  std::vector<std::string> names = {"publisher"};
  names.insert(names.end(), members.begin(), members.end());
  GroupOptions go;
  go.world_size = static_cast<int>(names.size());
  go.backend = cfg_.data_plane.backend;
  go.bootstrap = *bootstrap;
  go.init_timeout = init_timeout;
  go.op_timeout = cfg_.publisher.update_timeout;
  go.stall_timeout = cfg_.data_plane.stall_timeout;
  if (cfg_.publisher.on_slow_member == SlowMemberPolicy::kShed) {
    go.shed_floor = cfg_.publisher.slow_member_floor;
    go.shed_window = cfg_.publisher.slow_member_window;
  }
  go.local = local_;
  // Backend shm: each reader its own secret too (by its group rank).
  if (cfg_.data_plane.backend == Backend::kShm && local_.empty()) {
    auto secrets = rank_secrets(names.size(), epoch);
    if (!secrets.ok()) return secrets.status();
    shm_secrets_ = std::move(*secrets);
  }
  auto shm_main = cfg_.data_plane.backend == Backend::kShm ? shm_backend::Bootstrap::parse(*bootstrap)
                                                           : StatusOr<shm_backend::Bootstrap>(shm_backend::Bootstrap{});
  auto shm_local = local_bootstrap_.empty() ? StatusOr<shm_backend::Bootstrap>(shm_backend::Bootstrap{})
                                            : shm_backend::Bootstrap::parse(local_bootstrap_);
  if (!shm_main.ok()) return shm_main.status();
  if (!shm_local.ok()) return shm_local.status();
  size_t shm_rank = 0;  // a local member's rank on the shm plane
  for (size_t i = 0; i < members.size(); ++i) {
    go.rank = static_cast<int>(i + 1);
    // The shm plane's bootstrap goes to the members that read it, nobody
    // else, each with its own secret: it attaches as its own rank only.
    go.local_bootstrap.clear();
    if (!local_.empty() && local_[i + 1]) go.local_bootstrap = shm_local->with_secret(shm_secrets_.at(++shm_rank));
    go.bootstrap = cfg_.data_plane.backend == Backend::kShm && local_.empty()
                       ? shm_main->with_secret(shm_secrets_.at(i + 1))
                       : *bootstrap;
    server_.send(members[i], control::make_message(epoch, server_.incarnation(), [&](auto b) {
                   fill_join_group(b.initJoinGroup(), go, names);
                 }));
  }
  return bootstrap;
}

void GroupHost::note_failure_locked(const std::string& who) {
  if (have_failure_) return;
  have_failure_ = true;
  first_failure_ = Clock::now();
  first_failed_ = who;
}

void GroupHost::wait_for_members(const std::vector<std::string>& members, Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (stopped_) return;
    bool pending = false;
    for (const auto& id : members) {
      if (ready_.count(id) || failed_.count(id)) continue;
      if (!server_.is_live(id)) return;  // it will never answer: fail now
      pending = true;
    }
    if (!pending) return;
    // After the first failure, the others' reports for the rest of the
    // window: a member's failure is often the echo of another's (a peer
    // that gave up closes its pairs), and the verdict needs every word.
    Clock::time_point until = deadline;
    if (have_failure_) until = std::min(until, first_failure_ + kEvidenceWindow);
    if (Clock::now() >= until) return;
    cv_.wait_until(lock, until);
  }
}

bool GroupHost::on_message(const std::string& id, proto::Envelope::Reader env) {
  using B = proto::Envelope::Body;
  auto body = env.getBody();
  // Whether a report is of the formation under way is decided under mu_,
  // with the state it goes into: form() starts an epoch and clears that
  // state in one step, so a report of the last epoch is never taken as one
  // of the next (read before mu_, an honest member's echo of the epoch the
  // publisher had just ended failed the next formation, naming it).
  const uint64_t epoch = env.getEpoch();
  switch (body.which()) {
    case B::GROUP_READY: {
      // A Gloo-plane member cannot be ready without its address in the store.
      const bool needs_address = cfg_.data_plane.backend == Backend::kGloo && store_rank(id) >= 1;
      std::lock_guard<std::mutex> lock(mu_);
      auto rank = assigned_rank_.find(id);
      if (epoch != epoch_ || rank == assigned_rank_.end()) break;  // not a member of this formation
      if (needs_address && !published_.count(id)) {
        false_ready_.insert(id);
        failed_[id] = kFalseReady;
        note_failure_locked(id);
      } else if (static_cast<int64_t>(body.getGroupReady().getRank()) == rank->second) {
        ready_.insert(id);
      } else {
        failed_[id] = "said GroupReady for rank " + std::to_string(body.getGroupReady().getRank()) +
                      " but was assigned rank " + std::to_string(rank->second);
        note_failure_locked(id);
      }
      break;
    }
    case B::GROUP_FAILED: {
      auto f = body.getGroupFailed();
      std::lock_guard<std::mutex> lock(mu_);
      if (epoch != epoch_ || !assigned_rank_.count(id)) break;
      failed_[id] = f.getReason().cStr();
      // Evidence: ranks of this group only, at most one entry each (hostile input).
      const auto world = static_cast<uint32_t>(assigned_rank_.size() + 1);
      FormationEvidence e;
      auto take = [&](auto list, std::vector<int>& into) {
        if (list.size() > world) return;
        for (uint32_t r : list)
          if (r < world && std::find(into.begin(), into.end(), static_cast<int>(r)) == into.end())
            into.push_back(static_cast<int>(r));
      };
      take(f.getUnreachable(), e.unreachable);
      take(f.getNoAddress(), e.no_address);
      if (!e.empty()) evidence_[id] = std::move(e);
      else failed_alone_.insert(id);
      if (e.empty() && f.getConnected()) connected_.insert(id);
      note_failure_locked(id);
      break;
    }
    case B::STORE_SET: {
      auto s = body.getStoreSet();
      Status st = store_.remote_set(id, store_rank(id), s.getKey().cStr(),
                                    std::string(reinterpret_cast<const char*>(s.getValue().begin()), s.getValue().size()));
      if (!st.ok()) {
        server_.note_dropped(id, st.message());
      } else {
        std::lock_guard<std::mutex> lock(mu_);
        if (epoch == epoch_) published_.insert(id);
      }
      return true;
    }
    case B::STORE_GET: {
      Status st = store_.remote_get(id, store_rank(id), body.getStoreGet().getRequestId(),
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
  std::shared_ptr<LinkCheckHost> checks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    checks = std::move(checks_);
  }
  cv_.notify_all();
  if (checks) checks->stop();  // its thread calls due_checks(): stopped without mu_ held
}

}  // namespace paramcast::group
