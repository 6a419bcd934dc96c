// FileStore: a Store over a directory that every rank can read (a local temp
// dir, or a shared filesystem). ParamCast itself rendezvouses through the
// publisher's control channel; this store serves tools that form a raw
// communicator without a publisher: the data-plane conformance suite and the
// benchmark's baseline broadcast.
#pragma once

#include <string>

#include "common/data/store.h"

namespace paramcast {

class FileStore : public Store {
 public:
  explicit FileStore(std::string dir) : dir_(std::move(dir)) {}
  // Writes atomically (temp file + rename).
  Status set(const std::string& key, const std::string& value) override;
  // Polls for the key's file until it appears or `timeout` passes.
  StatusOr<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override;

 private:
  std::string path(const std::string& key) const;
  std::string dir_;
};

}  // namespace paramcast
