#include "common/group/group_member.h"

#include <algorithm>

#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdlib>
#include <cstring>
#include <thread>

#include "common/control/messages.h"
#include "common/log.h"

namespace paramcast::group {

// The store's way to the publisher: the client, until the member is gone
// (an abandoned attempt may still use the store after that).
struct GroupMember::Link {
  std::mutex mu;
  control::ControlClient* client;
  std::atomic<uint64_t> epoch{0};  // the epoch being joined, stamped on store messages
};

struct GroupMember::Attempt {
  explicit Attempt(uint64_t e) : epoch(e) {}
  const uint64_t epoch;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::string abandoned;  // non-empty: join() stopped waiting, and why
  StatusOr<std::unique_ptr<Communicator>> result{unavailable("formation attempt not finished")};
  FormationEvidence evidence;  // what this rank saw of its peers, when it failed
};

namespace {
// PARAMCAST_FAULT_BAD_ADDRESS: each address record (a sockaddr_storage and a
// sequence number, data/gloo/mesh.cc) gets port 1.
std::string with_bad_port(std::string value) {
  constexpr size_t kRecord = sizeof(sockaddr_storage) + sizeof(int64_t);
  if (value.size() % kRecord != 0) return value;
  for (size_t at = 0; at < value.size(); at += kRecord) {
    sockaddr_storage ss;
    std::memcpy(&ss, value.data() + at, sizeof ss);
    const uint16_t port = htons(1);
    if (ss.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&ss)->sin_port = port;
    if (ss.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = port;
    std::memcpy(value.data() + at, &ss, sizeof ss);
  }
  return value;
}
}  // namespace

GroupMember::GroupMember(std::string worker_id, control::ControlClient& client)
    : id_(std::move(worker_id)), client_(client), link_(std::make_shared<Link>()) {
  link_->client = &client;
  const char* lie = std::getenv("PARAMCAST_FAULT_FALSE_READY");
  false_ready_ = lie && std::strcmp(lie, "1") == 0;
  if (const char* accuse = std::getenv("PARAMCAST_FAULT_ACCUSE")) {
    std::string list = accuse;
    for (size_t at = 0; at <= list.size();) {
      const size_t end = std::min(list.find(',', at), list.size());
      if (end > at) accuse_.push_back(list.substr(at, end - at));
      at = end + 1;
    }
  }
  if (const char* ms = std::getenv("PARAMCAST_FAULT_REPORT_AFTER_MS")) report_after_ = Millis(std::atoll(ms));
  const char* echo = std::getenv("PARAMCAST_FAULT_FAIL_FIRST_FORMATION");
  fail_first_ = echo && std::strcmp(echo, "1") == 0;
  const char* bad = std::getenv("PARAMCAST_FAULT_BAD_ADDRESS");
  const bool bad_address = bad && std::strcmp(bad, "1") == 0;
  store_ = std::make_shared<RemoteStore>([link = link_, bad_address](const RemoteStore::Request& r) {
    std::lock_guard<std::mutex> lock(link->mu);
    if (!link->client) return;
    link->client->send(control::make_message(link->epoch, link->client->incarnation(), [&](auto b) {
      if (r.is_get) {
        auto m = b.initStoreGet();
        m.setRequestId(r.request_id);
        m.setKey(r.key);
      } else {
        auto m = b.initStoreSet();
        m.setKey(r.key);
        const std::string value = bad_address ? with_bad_port(r.value) : r.value;
        m.setValue(kj::arrayPtr(reinterpret_cast<const kj::byte*>(value.data()), value.size()));
      }
    }));
  });
}

GroupMember::~GroupMember() {
  end_attempt(~uint64_t(0), "subscriber stopping");
  store_->fail("subscriber stopping");
  std::lock_guard<std::mutex> lock(link_->mu);
  link_->client = nullptr;
}

void GroupMember::on_joined() {
  abandoned_ = 0;
  store_->reset();
}

void GroupMember::on_unavailable(const std::string& why) {
  store_->fail(why);
  end_attempt(~uint64_t(0), why);
}

void GroupMember::abandon_formations(uint64_t epoch, const std::string& why) {
  uint64_t seen = abandoned_.load();
  while (seen < epoch && !abandoned_.compare_exchange_weak(seen, epoch)) {
  }
  {
    // Atomic with join()'s switch to a new epoch: an abandon of epoch N
    // that lands while epoch N+1 starts must not fail N+1's store.
    std::lock_guard<std::mutex> lock(mu_);
    if (link_->epoch.load() != 0 && link_->epoch.load() <= epoch) {
      store_failed_by_abandon_ = true;
      store_->fail(why);
    }
  }
  end_attempt(epoch, why);
}

// Stops join() waiting for an attempt at an epoch up to `up_to_epoch`.
void GroupMember::end_attempt(uint64_t up_to_epoch, const std::string& why) {
  std::shared_ptr<Attempt> a;
  {
    std::lock_guard<std::mutex> lock(mu_);
    a = attempt_;
  }
  if (!a || a->epoch > up_to_epoch) return;
  {
    std::lock_guard<std::mutex> lock(a->mu);
    if (a->done || !a->abandoned.empty()) return;
    a->abandoned = why.empty() ? "formation abandoned" : why;
  }
  a->cv.notify_all();
}

StatusOr<std::shared_ptr<Communicator>> GroupMember::join(const GroupOptions& options) {
  if (false_ready_) {  // test hook: a member that claims readiness it does not have
    client_.send(control::make_message(options.epoch, client_.incarnation(), [&](auto b) {
      b.initGroupReady().setRank(static_cast<uint32_t>(options.rank));
    }));
    return unavailable("PARAMCAST_FAULT_FALSE_READY: said GroupReady without a communicator");
  }
  held_by_hook_.reset();  // a test hook's communicator of the last formation
  auto attempt = std::make_shared<Attempt>(options.epoch);
  {
    std::lock_guard<std::mutex> lock(mu_);  // against abandon_formations() of an older epoch
    if (store_failed_by_abandon_.exchange(false)) store_->reset();  // that formation is over; this one is new
    link_->epoch = options.epoch;
    attempt_ = attempt;
  }
  if (options.epoch <= abandoned_.load()) {
    attempt->result = unavailable("group epoch " + std::to_string(options.epoch) +
                                  " was abandoned before this rank joined it");
    attempt->done = true;
  } else {
    std::thread([attempt, options, store = store_] {
      FormationEvidence evidence;
      auto result = create_communicator(options, *store, &evidence);
      std::unique_ptr<Communicator> orphan;  // built after join() gave up: torn down here
      {
        std::lock_guard<std::mutex> lock(attempt->mu);
        attempt->evidence = std::move(evidence);
        if (!attempt->abandoned.empty() && result.ok()) orphan = std::move(result.value());
        else attempt->result = std::move(result);
        attempt->done = true;
      }
      attempt->cv.notify_all();
    }).detach();
  }
  std::unique_lock<std::mutex> lock(attempt->mu);
  attempt->cv.wait(lock, [&] { return attempt->done || !attempt->abandoned.empty(); });
  const FormationEvidence evidence_seen = attempt->done ? attempt->evidence : FormationEvidence();
  StatusOr<std::unique_ptr<Communicator>> comm =
      attempt->done ? std::move(attempt->result)
                    : StatusOr<std::unique_ptr<Communicator>>(unavailable(
                          "group epoch " + std::to_string(options.epoch) + " abandoned: " + attempt->abandoned));
  lock.unlock();
  const auto rank = static_cast<uint32_t>(options.rank);
  FormationEvidence evidence = evidence_seen;
  // The two hooks below say a formation failed that connected: its
  // communicator stays open until this member's next join(), so that a peer
  // still connecting its own mesh sees only the lie, never a closed pair.
  auto fail_by_hook = [&](std::string why) {
    held_by_hook_ = reaper_.adopt(std::move(comm.value()));
    comm = StatusOr<std::unique_ptr<Communicator>>(unavailable(std::move(why)));
  };
  if (fail_first_) {  // test hook: the echo of another member's failure, without evidence
    fail_first_ = false;  // its first formation, whatever became of it
    if (comm.ok()) fail_by_hook("PARAMCAST_FAULT_FAIL_FIRST_FORMATION: a peer closed its pair (no evidence)");
  }
  if (comm.ok() && !accuse_.empty()) {  // test hook: it reached them, and says it did not
    for (size_t r = 0; r < options.members.size(); ++r)
      if (std::find(accuse_.begin(), accuse_.end(), options.members[r]) != accuse_.end())
        evidence.unreachable.push_back(static_cast<int>(r));
    if (!evidence.unreachable.empty())
      fail_by_hook("PARAMCAST_FAULT_ACCUSE: claims it could not reach " + std::to_string(evidence.unreachable.size()) +
                   " peers");
  }
  if (report_after_.count() > 0) std::this_thread::sleep_for(report_after_);  // test hook: a slow control path
  if (!comm.ok()) {
    PC_WARN(id_ << ": group epoch " << options.epoch << " failed: " << comm.status().message());
    client_.send(control::make_message(options.epoch, client_.incarnation(), [&](auto b) {
      auto f = b.initGroupFailed();
      f.setRank(rank);
      f.setReason(comm.status().to_string());
      auto unreachable = f.initUnreachable(static_cast<unsigned>(evidence.unreachable.size()));
      for (size_t i = 0; i < evidence.unreachable.size(); ++i)
        unreachable.set(static_cast<unsigned>(i), static_cast<uint32_t>(evidence.unreachable[i]));
      f.setConnected(evidence.connected && evidence.empty());
      auto no_address = f.initNoAddress(static_cast<unsigned>(evidence.no_address.size()));
      for (size_t i = 0; i < evidence.no_address.size(); ++i)
        no_address.set(static_cast<unsigned>(i), static_cast<uint32_t>(evidence.no_address[i]));
    }));
    return comm.status();
  }
  PC_INFO(id_ << ": rank " << options.rank << " of " << options.world_size << " in group epoch " << options.epoch);
  client_.send(control::make_message(options.epoch, client_.incarnation(),
                                     [&](auto b) { b.initGroupReady().setRank(rank); }));
  return reaper_.adopt(std::move(comm.value()));
}

}  // namespace paramcast::group
