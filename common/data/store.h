// Store: the key-value rendezvous that data-plane backends use to exchange
// addresses while a group forms (the role of gloo's rendezvous::Store).
//
// ParamCast has no separate store server: the publisher hosts the store and
// subscribers reach it over the control channel (StoreSet / StoreGet), so a
// deployment needs no extra port, no shared filesystem, no Redis.
//
// Thread-safety: implementations are safe to call from any thread.
#pragma once

#include <chrono>
#include <string>

#include "common/status.h"

namespace paramcast {

class Store {
 public:
  virtual ~Store() = default;
  virtual Status set(const std::string& key, const std::string& value) = 0;
  // Waits until `key` exists or `timeout` passes (kTimeout naming the key).
  virtual StatusOr<std::string> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // Why the formation this store serves is over ("" while it goes on): a
  // backend that waits on its peers for other reasons (Gloo's connects) polls
  // it, so a formation another rank ended does not hold this one.
  virtual std::string cancelled() { return ""; }
};

}  // namespace paramcast
