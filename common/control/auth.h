// CURVE authentication of the control channel (see docs/security.md).
//
// Keys are ZeroMQ CURVE key pairs in Z85 text. A key file holds
//   public-key = <40 characters>
//   secret-key = <40 characters>     (only in NAME.key, mode 0600)
// An authorized-keys file binds one name per line to a public key:
//   <worker-id> <public key>   [# comment after whitespace]
// ('#' is a Z85 character: a comment is a whole line starting with '#', or
// what follows the key after whitespace).
// The publisher's ZapHandler answers ZeroMQ's handshake requests
// (inproc://zeromq.zap.01): a key listed in the workers' file is admitted with
// User-Id = the worker id, a key in the status file with User-Id
// "status:<name>"; any other key is refused before a single message passes.
//
// Thread-safety: the functions are pure; a ZapHandler owns one thread.
#pragma once

#include <zmq.hpp>

#include <atomic>
#include <map>
#include <string>
#include <thread>

#include "common/config.h"
#include "common/control/log_guard.h"
#include "common/status.h"

namespace paramcast::control {

// Empty when this libzmq can do CURVE; otherwise why not, for the user.
std::string curve_unavailable_reason();

struct KeyPair {
  std::string public_key;  // Z85, 40 characters
  std::string secret_key;  // Z85, 40 characters; empty when only the public half is known
};

StatusOr<KeyPair> generate_key_pair();
// Writes BASE.key (both halves, mode 0600) and BASE.pub (public half only).
Status write_key_pair(const std::string& base, const KeyPair& keys);
// Reads a .key or .pub file; `need_secret` makes a missing secret half an error.
StatusOr<KeyPair> read_key_file(const std::string& path, bool need_secret);
// Short stable name of a public key for log lines: "xxh64:<16 hex>".
std::string key_fingerprint(const std::string& z85_public);
// public key -> name (`prefix` + the name in the file). Errors name file:line.
StatusOr<std::map<std::string, std::string>> read_authorized_keys(const std::string& path, const std::string& prefix);

// What the publisher's socket needs (mode curve).
struct ServerAuth {
  bool curve = false;
  KeyPair keys;
  std::map<std::string, std::string> users;  // public key -> User-Id (worker id or "status:<name>")
};
// What a subscriber's (or `paramcast status`'s) sockets need (mode curve).
struct ClientAuth {
  bool curve = false;
  KeyPair keys;
  std::string server_public_key;
};

// From the auth block of a config; plain mode yields curve = false.
StatusOr<ServerAuth> server_auth(const AuthOptions& auth);
// `key_file` empty: auth.worker_key with {id} replaced by `worker_id`.
StatusOr<ClientAuth> client_auth(const AuthOptions& auth, const std::string& worker_id, std::string key_file = "");

void apply_server_auth(zmq::socket_t& socket, const ServerAuth& auth);
void apply_client_auth(zmq::socket_t& socket, const ClientAuth& auth);

// Answers ZAP requests for one context until destroyed.
class ZapHandler {
 public:
  ZapHandler(zmq::context_t& ctx, std::map<std::string, std::string> users);
  ~ZapHandler();
  ZapHandler(const ZapHandler&) = delete;
  ZapHandler& operator=(const ZapHandler&) = delete;

  uint64_t refused() const { return refused_; }

 private:
  void loop();
  bool answer();

  const std::map<std::string, std::string> users_;
  zmq::socket_t socket_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> refused_{0};
  LogLimiter limiter_{5, std::chrono::seconds(10)};  // handler thread only
  std::thread thread_;
};

}  // namespace paramcast::control
