// StoreAdapter: presents a ParamCast Store to Gloo's rendezvous, which reports
// failures by exception. Internal to the Gloo backend.
#pragma once

#include <gloo/common/error.h>
#include <gloo/rendezvous/store.h>

#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "common/data/store.h"

namespace paramcast::gloo_backend {

// What Gloo writes to the store, with the bytes it never initialised zeroed:
// an address blob is one record per peer (a sockaddr_storage of which only
// the family's length is set, then a sequence number); a "rank_N" value is a
// host name in a fixed buffer, of which only the part up to its NUL is set.
inline std::string defined_bytes(const std::string& key, const std::vector<char>& data) {
  std::string out(data.begin(), data.end());
  const auto slash = key.rfind('/');
  if (key.compare(slash == std::string::npos ? 0 : slash + 1, 5, "rank_") == 0) {
    const auto nul = out.find('\0');
    if (nul != std::string::npos) std::fill(out.begin() + static_cast<std::ptrdiff_t>(nul), out.end(), '\0');
    return out;
  }
  constexpr size_t kRecord = sizeof(sockaddr_storage) + sizeof(ssize_t);
  if (out.empty() || out.size() % kRecord != 0) return out;
  for (size_t at = 0; at < out.size(); at += kRecord) {
    sockaddr_storage ss;
    std::memcpy(&ss, out.data() + at, sizeof ss);
    size_t used = ss.ss_family == AF_INET ? sizeof(sockaddr_in) : ss.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : 0;
    if (ss.ss_family == AF_INET) std::memset(reinterpret_cast<sockaddr_in*>(&ss)->sin_zero, 0, sizeof(sockaddr_in::sin_zero));
    std::memset(reinterpret_cast<char*>(&ss) + used, 0, sizeof ss - used);
    std::memcpy(out.data() + at, &ss, sizeof ss);
  }
  return out;
}

class StoreAdapter : public ::gloo::rendezvous::Store {
 public:
  StoreAdapter(paramcast::Store& store, std::chrono::milliseconds timeout) : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Status s = store_.set(key, defined_bytes(key, data));
    if (!s.ok()) throw ::gloo::IoException("store set '" + key + "': " + s.to_string());
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_.get(key, timeout_);
    if (!v.ok()) throw ::gloo::IoException("store get '" + key + "': " + v.status().to_string());
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    for (const auto& key : keys) {
      auto v = store_.get(key, timeout);
      if (!v.ok()) throw ::gloo::IoException("store wait '" + key + "': " + v.status().to_string());
    }
  }

 private:
  paramcast::Store& store_;
  std::chrono::milliseconds timeout_;
};

}  // namespace paramcast::gloo_backend
