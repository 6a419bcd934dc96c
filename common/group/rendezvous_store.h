// The rendezvous store of group formation, served over the control channel
// (gloo's rendezvous::Store role, without a separate server).
//
// HostedStore lives in the publisher: rank 0 uses it directly, and members'
// StoreSet / StoreGet arrive through the control thread; a get for a key not
// yet set is parked and answered when the key arrives. Members are hostile
// until proven otherwise, so their requests are scoped:
//   - keys live under the current epoch's prefix ("paramcast/epoch-<N>/", the
//     Gloo bootstrap of that epoch); a member may read any key of it, and
//     write only keys that name its own rank: the suffix after the prefix is
//     letters or '_' followed by the rank ("1", "rank_1");
//   - each member may hold kMemberKeys keys, kMemberBytes in all, and park
//     kMemberGets gets;
//   - begin_epoch() and end_epoch() drop every key and parked get, so nothing
//     written in one epoch outlives it or reaches a later one.
//
// RemoteStore lives in a subscriber: set/get become StoreSet / StoreGet
// messages, and the control thread delivers each StoreValue. fail() ends
// every waiting get (publisher lost, stopping) until reset().
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/data/store.h"

namespace paramcast::group {

class HostedStore : public Store {
 public:
  // Sends a StoreValue answering `request_id` to `peer`.
  using Reply = std::function<void(const std::string& peer, uint64_t request_id, const std::string& key,
                                    const std::string& value)>;
  explicit HostedStore(Reply reply) : reply_(std::move(reply)) {}

  Status set(const std::string& key, const std::string& value) override;
  StatusOr<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override;

  static constexpr size_t kMemberKeys = 8;
  static constexpr size_t kMemberBytes = 1u << 20;
  static constexpr size_t kMemberGets = 64;

  // Control thread: a member's StoreSet / StoreGet, `rank` its rank in the
  // current group (-1: not in it). An error says why it was refused.
  Status remote_set(const std::string& member, int rank, const std::string& key, std::string value);
  Status remote_get(const std::string& member, int rank, uint64_t request_id, const std::string& key);

  // Drops everything and scopes keys to `epoch` (see mint_bootstrap).
  void begin_epoch(uint64_t epoch);
  // Drops everything; no key is accepted until the next begin_epoch.
  void end_epoch();
  size_t size() const;
  size_t bytes() const;

 private:
  struct ParkedGet {
    std::string peer;
    uint64_t request_id;
    std::string key;
  };
  struct Usage {
    size_t keys = 0, bytes = 0, gets = 0;
  };
  void put(const std::string& key, std::string value);
  Status check_scope_locked(const std::string& member, int rank, const std::string& key) const;

  const Reply reply_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string prefix_;  // empty: between epochs, members may not use the store
  std::map<std::string, std::string> values_;
  std::map<std::string, std::string> writer_;  // key -> member who wrote it
  std::map<std::string, Usage> usage_;         // member -> what it holds
  std::vector<ParkedGet> parked_;
};

class RemoteStore : public Store {
 public:
  struct Request {
    bool is_get;
    uint64_t request_id;  // gets only
    std::string key;
    std::string value;    // sets only
  };
  // Sends one StoreSet or StoreGet to the publisher.
  using Send = std::function<void(const Request&)>;
  explicit RemoteStore(Send send) : send_(std::move(send)) {}

  Status set(const std::string& key, const std::string& value) override;
  StatusOr<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override;

  std::string cancelled() override;

  void deliver(uint64_t request_id, std::string value);
  void fail(const std::string& why);
  void reset();

 private:
  const Send send_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_request_ = 0;
  std::map<uint64_t, std::string> values_;
  std::string failed_;  // non-empty: why every get fails now
};

}  // namespace paramcast::group
