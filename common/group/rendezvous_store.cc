#include "common/group/rendezvous_store.h"

#include <cctype>

#include "common/control/log_guard.h"

namespace paramcast::group {

Status HostedStore::set(const std::string& key, const std::string& value) {
  put(key, value);
  return Status();
}

Status HostedStore::check_scope_locked(const std::string& member, int rank, const std::string& key) const {
  const std::string shown = "rendezvous key '" + control::printable(key) + "' from '" + member + "'";
  if (rank < 1) return rejected(shown + " refused: the member is not in the group that is forming");
  if (prefix_.empty() || key.compare(0, prefix_.size(), prefix_) != 0)
    return rejected(shown + " refused: not a key of the forming group's epoch (" +
                             (prefix_.empty() ? std::string("none is forming") : prefix_ + "...") + ")");
  return Status();
}

Status HostedStore::remote_set(const std::string& member, int rank, const std::string& key, std::string value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    PC_RETURN_IF_ERROR(check_scope_locked(member, rank, key));
    // The suffix names the writer's rank: letters or '_', then the rank.
    const std::string suffix = key.substr(prefix_.size());
    size_t digits = suffix.size();
    while (digits > 0 && std::isdigit(static_cast<unsigned char>(suffix[digits - 1]))) --digits;
    bool letters = true;
    for (size_t i = 0; i < digits; ++i) letters &= std::isalpha(static_cast<unsigned char>(suffix[i])) || suffix[i] == '_';
    if (!letters || digits == suffix.size() || suffix.substr(digits) != std::to_string(rank))
      return rejected("rendezvous key '" + control::printable(key) + "' from '" + member +
                               "' refused: a member writes only keys of its own rank " + std::to_string(rank));
    auto w = writer_.find(key);
    if (w != writer_.end()) return rejected("rendezvous key '" + control::printable(key) + "' from '" + member + "' refused: already set");
    Usage& u = usage_[member];
    if (u.keys + 1 > kMemberKeys || u.bytes + key.size() + value.size() > kMemberBytes)
      return rejected("rendezvous key '" + control::printable(key) + "' from '" + member + "' refused: quota of " +
                                std::to_string(kMemberKeys) + " keys / " + std::to_string(kMemberBytes) +
                                " bytes per member and epoch reached (holds " + std::to_string(u.keys) + " keys, " +
                                std::to_string(u.bytes) + " bytes; this one is " + std::to_string(value.size()) + ")");
    ++u.keys;
    u.bytes += key.size() + value.size();
    writer_[key] = member;
  }
  put(key, std::move(value));
  return Status();
}

void HostedStore::put(const std::string& key, std::string value) {
  std::vector<ParkedGet> ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    values_[key] = value;
    // Members may already be waiting for this key.
    for (auto it = parked_.begin(); it != parked_.end();) {
      if (it->key == key) {
        auto u = usage_.find(it->peer);
        if (u != usage_.end() && u->second.gets > 0) --u->second.gets;
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

Status HostedStore::remote_get(const std::string& member, int rank, uint64_t request_id, const std::string& key) {
  std::string value;
  {
    std::lock_guard<std::mutex> lock(mu_);
    PC_RETURN_IF_ERROR(check_scope_locked(member, rank, key));
    auto it = values_.find(key);
    if (it == values_.end()) {
      Usage& u = usage_[member];
      if (u.gets >= kMemberGets)
        return rejected("rendezvous get of '" + control::printable(key) + "' from '" + member +
                                  "' refused: " + std::to_string(kMemberGets) + " gets already waiting");
      ++u.gets;
      parked_.push_back({member, request_id, key});
      return Status();
    }
    value = it->second;
  }
  reply_(member, request_id, key, value);
  return Status();
}

void HostedStore::begin_epoch(uint64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  prefix_ = "paramcast/epoch-" + std::to_string(epoch) + "/";  // the Gloo bootstrap of mint_bootstrap()
  values_.clear();
  writer_.clear();
  usage_.clear();
  parked_.clear();
}

void HostedStore::end_epoch() {
  std::lock_guard<std::mutex> lock(mu_);
  prefix_.clear();
  values_.clear();
  writer_.clear();
  usage_.clear();
  parked_.clear();
}

size_t HostedStore::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [k, v] : values_) n += k.size() + v.size();
  return n;
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

std::string RemoteStore::cancelled() {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
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
