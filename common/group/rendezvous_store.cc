#include "common/group/rendezvous_store.h"

namespace paramcast::group {

Status HostedStore::set(const std::string& key, const std::string& value) {
  put(key, value);
  return Status();
}

void HostedStore::remote_set(const std::string& key, std::string value) { put(key, std::move(value)); }

void HostedStore::put(const std::string& key, std::string value) {
  std::vector<ParkedGet> ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    values_[key] = value;
    // Members may already be waiting for this key.
    for (auto it = parked_.begin(); it != parked_.end();) {
      if (it->key == key) {
        ready.push_back(std::move(*it));
        it = parked_.erase(it);
      } else {
        ++it;
      }
    }
  }
  cv_.notify_all();
  for (const auto& g : ready) reply_(g.peer, g.request_id, g.key, value);
}

StatusOr<std::string> HostedStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return values_.count(key) > 0; }))
    return timeout_error("rendezvous key '" + key + "' not set within " + std::to_string(timeout.count()) + "ms");
  return values_[key];
}

void HostedStore::remote_get(const std::string& peer, uint64_t request_id, const std::string& key) {
  std::string value;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = values_.find(key);
    if (it == values_.end()) {
      parked_.push_back({peer, request_id, key});
      return;
    }
    value = it->second;
  }
  reply_(peer, request_id, key, value);
}

void HostedStore::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  values_.clear();
  parked_.clear();
}

size_t HostedStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return values_.size();
}

Status RemoteStore::set(const std::string& key, const std::string& value) {
  send_(Request{false, 0, key, value});
  return Status();
}

StatusOr<std::string> RemoteStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.empty()) return peer_lost(failed_ + " while waiting for rendezvous key '" + key + "'");
    id = ++next_request_;
  }
  send_(Request{true, id, key, {}});
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return values_.count(id) || !failed_.empty(); }))
    return timeout_error("rendezvous key '" + key + "' not available within " + std::to_string(timeout.count()) + "ms");
  if (!values_.count(id)) return peer_lost(failed_ + " while waiting for rendezvous key '" + key + "'");
  std::string v = std::move(values_[id]);
  values_.erase(id);
  return v;
}

void RemoteStore::deliver(uint64_t request_id, std::string value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (request_id == 0 || request_id > next_request_) return;  // never asked for
    values_[request_id] = std::move(value);
  }
  cv_.notify_all();
}

void RemoteStore::fail(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed_ = why.empty() ? "rendezvous store unavailable" : why;
    values_.clear();
  }
  cv_.notify_all();
}

void RemoteStore::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  failed_.clear();
}

}  // namespace paramcast::group
