// StoreAdapter: presents a ParamCast Store to Gloo's rendezvous, which reports
// failures by exception. Internal to the Gloo backend.
#pragma once

#include <gloo/common/error.h>
#include <gloo/rendezvous/store.h>

#include <chrono>
#include <string>
#include <vector>

#include "common/data/store.h"

namespace paramcast::gloo_backend {

class StoreAdapter : public ::gloo::rendezvous::Store {
 public:
  StoreAdapter(paramcast::Store& store, std::chrono::milliseconds timeout) : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Status s = store_.set(key, std::string(data.begin(), data.end()));
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
