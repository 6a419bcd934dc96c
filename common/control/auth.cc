#include "common/control/auth.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "common/control/log_guard.h"
#include "common/log.h"
#include "common/xxhash.h"

namespace paramcast::control {
namespace {

bool valid_z85_key(const std::string& k) {
  if (k.size() != 40) return false;
  uint8_t raw[32];
  return zmq_z85_decode(raw, k.c_str()) != nullptr;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\"");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\"");
  return s.substr(b, e - b + 1);
}

Status write_file(const std::string& path, const std::string& text, mode_t mode) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, mode);
  if (fd < 0) return invalid_argument(path + ": cannot create (" + std::strerror(errno) + "; an existing key is never overwritten)");
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && ::fchmod(fd, mode) == 0;
  ::close(fd);
  if (!ok) return internal_error(path + ": write failed: " + std::strerror(errno));
  return Status();
}

}  // namespace

std::string curve_unavailable_reason() {
  if (zmq_has("curve")) return "";
  return "this libzmq was built without CURVE security (zmq_has(\"curve\") is false): install a libzmq with "
         "libsodium/tweetnacl support, or set auth.mode: plain on a trusted network";
}

StatusOr<KeyPair> generate_key_pair() {
  if (auto why = curve_unavailable_reason(); !why.empty()) return unavailable(why);
  char pub[41], sec[41];
  if (zmq_curve_keypair(pub, sec) != 0) return internal_error(std::string("zmq_curve_keypair: ") + zmq_strerror(zmq_errno()));
  return KeyPair{pub, sec};
}

Status write_key_pair(const std::string& base, const KeyPair& keys) {
  const std::string head = "# ParamCast CURVE key pair (docs/security.md)\n";
  Status s = write_file(base + ".key",
                        head + "# SECRET: keep this file mode 0600 and on this host only\npublic-key = " +
                            keys.public_key + "\nsecret-key = " + keys.secret_key + "\n",
                        0600);
  if (!s.ok()) return s;
  return write_file(base + ".pub", head + "public-key = " + keys.public_key + "\n", 0644);
}

StatusOr<KeyPair> read_key_file(const std::string& path, bool need_secret) {
  std::ifstream in(path);
  if (!in) return invalid_argument(path + ": cannot open key file");
  KeyPair k;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    line = trim(line);  // '#' is a Z85 character: only whole lines are comments
    if (line.empty() || line[0] == '#') continue;
    const auto eq = line.find('=');
    const std::string name = eq == std::string::npos ? "" : trim(line.substr(0, eq));
    const std::string value = eq == std::string::npos ? "" : trim(line.substr(eq + 1));
    if ((name != "public-key" && name != "secret-key") || !valid_z85_key(value))
      return invalid_argument(path + ":" + std::to_string(n) +
                              ": expected 'public-key = KEY' or 'secret-key = KEY' (40 Z85 characters)");
    (name == "public-key" ? k.public_key : k.secret_key) = value;
  }
  if (k.public_key.empty()) return invalid_argument(path + ": no public-key line");
  if (need_secret && k.secret_key.empty())
    return invalid_argument(path + ": no secret-key line (this is a public key; the .key file holds both halves)");
  if (!k.secret_key.empty()) {
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && (st.st_mode & 077) != 0)
      PC_WARN(path << ": secret key file is readable by others (mode " << std::oct << (st.st_mode & 0777) << std::dec
                   << "); chmod 600 it");
  }
  return k;
}

std::string key_fingerprint(const std::string& z85_public) {
  char out[32];
  std::snprintf(out, sizeof out, "xxh64:%016llx",
                static_cast<unsigned long long>(xxh64(z85_public.data(), z85_public.size())));
  return out;
}

StatusOr<std::map<std::string, std::string>> read_authorized_keys(const std::string& path, const std::string& prefix) {
  std::ifstream in(path);
  if (!in) return invalid_argument(path + ": cannot open authorized keys file");
  std::map<std::string, std::string> users;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    line = trim(line);
    if (line.empty() || line[0] == '#') continue;
    std::istringstream is(line);
    std::string name, key, extra;
    is >> name >> key >> extra;
    if (!extra.empty() && extra[0] == '#') extra.clear();  // "NAME KEY  # comment"
    const std::string where = path + ":" + std::to_string(n) + ": ";
    if (key.empty() || !extra.empty()) return invalid_argument(where + "expected 'NAME PUBLIC-KEY'");
    if (!valid_z85_key(key)) return invalid_argument(where + "'" + printable(key, 64) + "' is not a 40-character Z85 public key");
    if (prefix.empty() && !valid_worker_id(name))
      return invalid_argument(where + "'" + printable(name, 64) + "' is not a valid worker id");
    if (!users.emplace(key, prefix + name).second)
      return invalid_argument(where + "public key " + key_fingerprint(key) + " is listed twice");
  }
  return users;
}

StatusOr<ServerAuth> server_auth(const AuthOptions& auth) {
  ServerAuth out;
  if (auth.mode != AuthMode::kCurve) return out;
  if (auto why = curve_unavailable_reason(); !why.empty()) return unavailable("auth.mode curve: " + why);
  auto keys = read_key_file(auth.publisher_key, /*need_secret=*/true);
  if (!keys.ok()) return invalid_argument("auth.publisher_key: " + keys.status().message());
  auto workers = read_authorized_keys(auth.authorized_keys, "");
  if (!workers.ok()) return invalid_argument("auth.authorized_keys: " + workers.status().message());
  out.curve = true;
  out.keys = *keys;
  out.users = std::move(*workers);
  if (!auth.status_keys.empty()) {
    auto readers = read_authorized_keys(auth.status_keys, "status:");
    if (!readers.ok()) return invalid_argument("auth.status_keys: " + readers.status().message());
    for (auto& [key, name] : *readers)
      if (!out.users.emplace(key, name).second)
        return invalid_argument("auth.status_keys: public key " + key_fingerprint(key) +
                                " is also a worker's key in auth.authorized_keys; give status readers their own keys");
  }
  return out;
}

StatusOr<ClientAuth> client_auth(const AuthOptions& auth, const std::string& worker_id, std::string key_file) {
  ClientAuth out;
  if (auth.mode != AuthMode::kCurve) return out;
  if (auto why = curve_unavailable_reason(); !why.empty()) return unavailable("auth.mode curve: " + why);
  if (key_file.empty()) {
    key_file = auth.worker_key;
    for (auto pos = key_file.find("{id}"); pos != std::string::npos; pos = key_file.find("{id}"))
      key_file.replace(pos, 4, worker_id);
  }
  if (key_file.empty()) return invalid_argument("auth.worker_key: not set (e.g. keys/{id}.key)");
  auto keys = read_key_file(key_file, /*need_secret=*/true);
  if (!keys.ok()) return invalid_argument("key of '" + worker_id + "': " + keys.status().message());
  auto server = read_key_file(auth.publisher_public_key, /*need_secret=*/false);
  if (!server.ok()) return invalid_argument("auth.publisher_public_key: " + server.status().message());
  out.curve = true;
  out.keys = *keys;
  out.server_public_key = server->public_key;
  return out;
}

void apply_server_auth(zmq::socket_t& socket, const ServerAuth& auth) {
  if (!auth.curve) return;
  socket.set(zmq::sockopt::curve_server, 1);
  socket.set(zmq::sockopt::curve_secretkey, auth.keys.secret_key);
  // The ZapHandler is bound before this socket: every handshake asks it.
  socket.set(zmq::sockopt::zap_domain, "paramcast");
}

void apply_client_auth(zmq::socket_t& socket, const ClientAuth& auth) {
  if (!auth.curve) return;
  socket.set(zmq::sockopt::curve_serverkey, auth.server_public_key);
  socket.set(zmq::sockopt::curve_publickey, auth.keys.public_key);
  socket.set(zmq::sockopt::curve_secretkey, auth.keys.secret_key);
}

// ----------------------------------------------------------------- ZAP

ZapHandler::ZapHandler(zmq::context_t& ctx, std::map<std::string, std::string> users)
    : users_(std::move(users)), socket_(ctx, zmq::socket_type::rep) {
  socket_.set(zmq::sockopt::linger, 0);
  socket_.bind("inproc://zeromq.zap.01");
  thread_ = std::thread([this] { loop(); });
}

ZapHandler::~ZapHandler() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void ZapHandler::loop() {
  while (!stop_) {
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    try {
      zmq::poll(&item, 1, std::chrono::milliseconds(50));
      if (item.revents & ZMQ_POLLIN) answer();
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) break;
    }
  }
  socket_.close();
}

// RFC 27: version, request id, domain, address, identity, mechanism, credentials.
bool ZapHandler::answer() {
  std::vector<zmq::message_t> req;
  do {
    req.emplace_back();
    if (!socket_.recv(req.back(), zmq::recv_flags::none)) return false;
  } while (socket_.get(zmq::sockopt::rcvmore) && req.size() < 16);
  std::string code = "400", text = "no such key", user;
  std::string fingerprint = "-";
  if (req.size() >= 7 && req[5].to_string() == "CURVE" && req[6].size() == 32) {
    char z85[41];
    zmq_z85_encode(z85, static_cast<const uint8_t*>(req[6].data()), 32);
    fingerprint = key_fingerprint(z85);
    auto it = users_.find(z85);
    if (it != users_.end()) {
      code = "200";
      text = "OK";
      user = it->second;
    }
  }
  uint64_t held_back = 0;
  if (code != "200") ++refused_;
  if (code != "200" && limiter_.allow("refused key", &held_back)) {
    PC_WARN("publisher: refused a connection from " << (req.size() > 3 ? printable(req[3].to_string_view(), 64) : "?")
                                                    << ": key " << fingerprint << " is not authorized"
                                                    << (held_back ? " (" + std::to_string(held_back) + " more refusals not logged)" : ""));
  }
  // Metadata: one property, the key's fingerprint, for log lines.
  std::string meta;
  const std::string name = "X-Key-Fingerprint";
  meta += static_cast<char>(name.size());
  meta += name;
  const uint32_t len = static_cast<uint32_t>(fingerprint.size());
  for (int shift = 24; shift >= 0; shift -= 8) meta += static_cast<char>((len >> shift) & 0xff);
  meta += fingerprint;
  const std::string frames[] = {"1.0", req.size() > 1 ? req[1].to_string() : "", code, text, user, meta};
  for (size_t i = 0; i < 6; ++i)
    socket_.send(zmq::buffer(frames[i]), i < 5 ? zmq::send_flags::sndmore : zmq::send_flags::none);
  return true;
}

}  // namespace paramcast::control
