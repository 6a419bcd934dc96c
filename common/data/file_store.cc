#include "common/data/file_store.h"

#include <fstream>
#include <sstream>
#include <thread>

namespace paramcast {

std::string FileStore::path(const std::string& key) const {
  std::string k = key;
  for (auto& c : k)
    if (c == '/') c = '_';
  return dir_ + "/" + k;
}

Status FileStore::set(const std::string& key, const std::string& value) {
  const std::string p = path(key);
  {
    std::ofstream out(p + ".tmp", std::ios::binary);
    out << value;
    if (!out) return unavailable("cannot write store key '" + key + "' under " + dir_);
  }
  if (std::rename((p + ".tmp").c_str(), p.c_str()) != 0)
    return unavailable("cannot publish store key '" + key + "' under " + dir_);
  return Status();
}

StatusOr<std::string> FileStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const std::string p = path(key);
  for (;;) {
    std::ifstream in(p, std::ios::binary);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      return ss.str();
    }
    if (std::chrono::steady_clock::now() >= deadline)
      return timeout_error("store key '" + key + "' did not appear under " + dir_ + " within " +
                           std::to_string(timeout.count()) + "ms");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace paramcast
