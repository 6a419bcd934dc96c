// The rendezvous store of group formation, served over the control channel
// (gloo's rendezvous::Store role, without a separate server).
//
// HostedStore lives in the publisher: rank 0 uses it directly, and members'
// StoreSet / StoreGet arrive through the control thread; a get for a key not
// yet set is parked and answered when the key arrives. clear() drops every
// key and parked get when a new epoch begins.
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

  // Control thread: a member's StoreSet / StoreGet.
  void remote_set(const std::string& key, std::string value);
  void remote_get(const std::string& peer, uint64_t request_id, const std::string& key);

  void clear();
  size_t size() const;

 private:
  struct ParkedGet {
    std::string peer;
    uint64_t request_id;
    std::string key;
  };
  void put(const std::string& key, std::string value);

  const Reply reply_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> values_;
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
