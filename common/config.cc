#include "common/config.h"

#include <yaml-cpp/yaml.h>

#include <charconv>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "common/log.h"
#include "common/units.h"

namespace paramcast {

const char* backend_name(Backend b) {
  return b == Backend::kNccl ? "nccl" : b == Backend::kShm ? "shm" : "gloo";
}
int backend_wire(Backend b) { return static_cast<int>(b); }  // the schema's enum has the same order
Backend backend_from_wire(int v) { return v == 1 ? Backend::kNccl : v == 2 ? Backend::kShm : Backend::kGloo; }

bool valid_worker_id(const std::string& id) {
  if (id.empty() || id.size() > 64 || id == "publisher") return false;
  for (char c : id)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') return false;
  return true;
}

namespace {

// Thrown inside the loader only, turned into a Status at its boundary.
struct ConfigError {
  std::string message;
};

class Loader {
 public:
  explicit Loader(std::string file) : file_(std::move(file)) {}

  // "file:line:column" of a node.
  std::string where(const YAML::Node& node) const {
    std::ostringstream os;
    os << file_;
    if (node.IsDefined() && node.Mark().line >= 0)
      os << ":" << node.Mark().line + 1 << ":" << node.Mark().column + 1;
    return os.str();
  }

  [[noreturn]] void fail(const YAML::Node& node, const std::string& path, const std::string& what) const {
    throw ConfigError{where(node) + ": key '" + path + "': " + what};
  }

  std::string scalar(const YAML::Node& n, const std::string& path, const char* expected) const {
    if (!n.IsScalar()) fail(n, path, std::string("expected ") + expected + ", got a " + kind(n));
    return n.Scalar();
  }

  static const char* kind(const YAML::Node& n) {
    switch (n.Type()) {
      case YAML::NodeType::Map: return "mapping";
      case YAML::NodeType::Sequence: return "list";
      case YAML::NodeType::Null: return "null value";
      default: return "scalar";
    }
  }

  Millis duration(const YAML::Node& n, const std::string& path, bool allow_zero = false) const {
    const std::string s = scalar(n, path, "a duration like 500ms or 10s");
    auto d = parse_duration(s);
    if (!d) fail(n, path, "bad value '" + s + "': expected a duration like 500ms or 10s (units ns, us, ms, s, m, h)");
    if (!allow_zero && d->count() <= 0) fail(n, path, "bad value '" + s + "': expected a positive duration");
    // Durations are kept in milliseconds: a fraction would be cut off silently
    // (500us would become 0, a busy loop), so it is refused.
    if (*d % Millis(1) != std::chrono::nanoseconds(0))
      fail(n, path, "bad value '" + s + "': not a whole number of milliseconds (durations here have 1ms resolution)");
    return std::chrono::duration_cast<Millis>(*d);
  }

  uint64_t size(const YAML::Node& n, const std::string& path, uint64_t min) const {
    const std::string s = scalar(n, path, "a size like 256MiB");
    auto v = parse_size(s);
    if (!v) fail(n, path, "bad value '" + s + "': expected a size like 4096, 64KiB, 256MiB or 1GiB");
    if (*v < min) fail(n, path, "bad value '" + s + "': must be at least " + std::to_string(min) + " bytes");
    return *v;
  }

  int64_t integer(const YAML::Node& n, const std::string& path, int64_t min, int64_t max) const {
    const std::string s = scalar(n, path, "an integer");
    int64_t v = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || p != s.data() + s.size())
      fail(n, path, "bad value '" + s + "': expected an integer");
    if (v < min || v > max)
      fail(n, path, "bad value '" + s + "': expected an integer in [" + std::to_string(min) + ", " +
                        std::to_string(max) + "]");
    return v;
  }

  bool boolean(const YAML::Node& n, const std::string& path) const {
    const std::string s = scalar(n, path, "true or false");
    if (s == "true") return true;
    if (s == "false") return false;
    fail(n, path, "bad value '" + s + "': expected true or false");
  }

  template <typename E>
  E choice(const YAML::Node& n, const std::string& path, const std::vector<std::pair<std::string, E>>& options) const {
    const std::string s = scalar(n, path, "one of the listed words");
    std::string names;
    for (auto& [name, value] : options) {
      if (name == s) return value;
      names += (names.empty() ? "" : ", ") + name;
    }
    fail(n, path, "bad value '" + s + "': expected one of " + names);
  }

  Device device(const YAML::Node& n, const std::string& path) const {
    const std::string s = scalar(n, path, "a device like cpu, cuda:1 or cuda:GPU-<uuid>");
    auto d = parse_device(s);
    if (!d.ok()) fail(n, path, "bad value '" + s + "': expected cpu, cuda or cuda:N, or cuda:GPU-<uuid>");
    return *d;
  }

  // Visits every key of a mapping; unknown keys are errors.
  void map(const YAML::Node& n, const std::string& path,
           const std::map<std::string, std::function<void(const YAML::Node&, const std::string&)>>& fields) const {
    if (!n.IsMap()) fail(n, path.empty() ? "<top level>" : path, std::string("expected a mapping, got a ") + kind(n));
    std::map<std::string, YAML::Mark> seen;
    for (auto it = n.begin(); it != n.end(); ++it) {
      const std::string key = it->first.as<std::string>();
      const std::string sub = path.empty() ? key : path + "." + key;
      auto [first, fresh] = seen.emplace(key, it->first.Mark());
      if (!fresh)
        fail(it->first, sub, "given twice (first at line " + std::to_string(first->second.line + 1) + ", again at line " +
                                 std::to_string(it->first.Mark().line + 1) + ")");
      auto f = fields.find(key);
      if (f == fields.end()) {
        std::string known;
        for (auto& [k, _] : fields) known += (known.empty() ? "" : ", ") + k;
        fail(it->first, sub, "unknown key (known keys here: " + known + ")");
      }
      f->second(it->second, sub);
    }
  }

 private:
  std::string file_;
};

// ---- auth block (docs/security.md)

std::string relative_to(const std::string& file, const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  const auto slash = file.rfind('/');
  return slash == std::string::npos ? path : file.substr(0, slash + 1) + path;
}

void parse_auth(const Loader& L, const YAML::Node& n, const std::string& p, const std::string& file, AuthOptions& a) {
  using N = const YAML::Node&;
  using P = const std::string&;
  auto path = [&](N v, P q) { return relative_to(file, L.scalar(v, q, "a file path")); };
  L.map(n, p, {
    {"mode", [&](N v, P q) {
      a.mode = L.choice<AuthMode>(v, q, {{"plain", AuthMode::kPlain}, {"curve", AuthMode::kCurve}});
      a.mode_given = true;
    }},
    {"publisher_key", [&](N v, P q) { a.publisher_key = path(v, q); }},
    {"publisher_public_key", [&](N v, P q) { a.publisher_public_key = path(v, q); }},
    {"authorized_keys", [&](N v, P q) { a.authorized_keys = path(v, q); }},
    {"status_keys", [&](N v, P q) { a.status_keys = path(v, q); }},
    {"worker_key", [&](N v, P q) { a.worker_key = path(v, q); }},
    {"status_key", [&](N v, P q) { a.status_key = path(v, q); }},
  });
  if (a.mode != AuthMode::kCurve) return;
  for (auto [key, value] : {std::pair<const char*, std::string*>{"publisher_public_key", &a.publisher_public_key},
                            {"authorized_keys", &a.authorized_keys}})
    if (value->empty()) L.fail(n, p + "." + key, "auth.mode curve needs this file (see docs/security.md)");
}

bool loopback_endpoint(const std::string& endpoint) {
  if (endpoint.starts_with("ipc://")) return true;
  const std::string host = endpoint.substr(6, endpoint.rfind(':') == std::string::npos ? std::string::npos
                                                                                      : endpoint.rfind(':') - 6);
  return host == "localhost" || host.starts_with("127.") || host == "[::1]" || host == "::1";
}

// Plain mode is for loopback development: anywhere else it must be chosen in writing.
void check_auth_for_endpoint(const Loader& L, const YAML::Node& root, const Config& c) {
  if (c.auth.mode_given || loopback_endpoint(c.control.endpoint)) return;
  const YAML::Node at = root["control"]["endpoint"].IsDefined() ? root["control"]["endpoint"] : root;
  L.fail(at, "auth.mode",
         "control.endpoint " + c.control.endpoint +
             " is not a loopback address: set auth.mode: curve (see docs/security.md), or auth.mode: plain to "
             "run unauthenticated on a trusted network");
}

void parse_control(const Loader& L, const YAML::Node& n, const std::string& p, Config& c) {
  using N = const YAML::Node&;
  using P = const std::string&;
    L.map(n, p, {
      {"endpoint", [&](N v, P q) {
        c.control.endpoint = L.scalar(v, q, "an endpoint like tcp://host:port");
        if (!c.control.endpoint.starts_with("tcp://") && !c.control.endpoint.starts_with("ipc://"))
          L.fail(v, q, "bad value '" + c.control.endpoint + "': expected tcp://HOST:PORT (or ipc://PATH)");
      }},
      {"heartbeat_interval", [&](N v, P q) { c.control.heartbeat_interval = L.duration(v, q); }},
      {"heartbeat_timeout", [&](N v, P q) { c.control.heartbeat_timeout = L.duration(v, q); }},
      {"join_timeout", [&](N v, P q) { c.control.join_timeout = L.duration(v, q); }},
      {"reconnect_backoff_max", [&](N v, P q) { c.control.reconnect_backoff_max = L.duration(v, q); }},
      {"max_message_size", [&](N v, P q) { c.control.max_message_bytes = L.size(v, q, 4096); }},
    });
    if (c.control.heartbeat_timeout <= c.control.heartbeat_interval)
      L.fail(n["heartbeat_timeout"].IsDefined() ? n["heartbeat_timeout"] : n, p + ".heartbeat_timeout",
             "must be longer than heartbeat_interval (" + std::to_string(c.control.heartbeat_interval.count()) +
                 "ms), got " + std::to_string(c.control.heartbeat_timeout.count()) + "ms");
}

void parse_data_plane(const Loader& L, const YAML::Node& n, const std::string& p, Config& c) {
  using N = const YAML::Node&;
  using P = const std::string&;
  bool stall_given = false;
    L.map(n, p, {
      {"backend", [&](N v, P q) {
        c.data_plane.backend = L.choice<Backend>(v, q, {{"gloo", Backend::kGloo}, {"nccl", Backend::kNccl}, {"shm", Backend::kShm}});
      }},
      {"gloo_hostname", [&](N v, P q) { c.data_plane.gloo_hostname = L.scalar(v, q, "a host name or address"); }},
      {"gloo_interface", [&](N v, P q) { c.data_plane.gloo_interface = L.scalar(v, q, "an interface name"); }},
      {"local", [&](N v, P q) { c.data_plane.local = L.choice<bool>(v, q, {{"auto", true}, {"off", false}}); }},
      {"bucket_size", [&](N v, P q) { c.data_plane.bucket_bytes = L.size(v, q, 4096); }},
      {"direct_min_size", [&](N v, P q) { c.data_plane.direct_min_bytes = L.size(v, q, 1); }},
      {"checksum", [&](N v, P q) {
        c.data_plane.checksum = L.choice<Checksum>(v, q, {{"none", Checksum::kNone}, {"xxh64", Checksum::kXxh64}, {"xxh64-blocks", Checksum::kXxh64Blocks}});
      }},
      {"stall_timeout", [&](N v, P q) {
        if (stall_given) L.fail(v, q, "given with data_plane.timeout, its old name: keep stall_timeout only");
        stall_given = true;
        c.data_plane.stall_timeout = L.duration(v, q);
      }},
      {"timeout", [&](N v, P q) {
        if (stall_given) L.fail(v, q, "old name of data_plane.stall_timeout, which is given too: keep stall_timeout only");
        stall_given = true;
        c.data_plane.stall_timeout = L.duration(v, q);
        PC_WARN(L.where(v) << ": data_plane.timeout is now data_plane.stall_timeout: a broadcast fails only after "
                              "no progress for that long; publisher.update_timeout caps the whole update");
      }},
      {"init_timeout", [&](N v, P q) { c.data_plane.init_timeout = L.duration(v, q); }},
    });
}

void parse_publisher(const Loader& L, const YAML::Node& n, const std::string& p, Config& c) {
  using N = const YAML::Node&;
  using P = const std::string&;
    L.map(n, p, {
      {"subscribers", [&](N v, P q) {
        if (v.IsSequence()) {
          std::set<std::string> seen;
          c.publisher.subscriber_ids.clear();
          for (size_t i = 0; i < v.size(); ++i) {
            const std::string qi = q + "[" + std::to_string(i) + "]";
            std::string id = L.scalar(v[i], qi, "a worker id");
            if (!valid_worker_id(id))
              L.fail(v[i], qi, "bad worker id '" + id + "': expected 1-64 of [A-Za-z0-9._-], not 'publisher' (reserved)");
            if (!seen.insert(id).second) L.fail(v[i], qi, "duplicate worker id '" + id + "'");
            c.publisher.subscriber_ids.push_back(id);
          }
          if (c.publisher.subscriber_ids.empty()) L.fail(v, q, "expected at least one worker id");
          c.publisher.subscriber_count = static_cast<int>(c.publisher.subscriber_ids.size());
        } else {
          c.publisher.subscriber_count = static_cast<int>(L.integer(v, q, 1, 4096));
        }
      }},
      {"device", [&](N v, P q) { c.publisher.device = L.device(v, q); }},
      {"ranks", [&](N v, P q) { c.publisher.ranks = static_cast<int>(L.integer(v, q, 1, 4096)); }},
      {"on_member_loss", [&](N v, P q) {
        c.publisher.on_member_loss = L.choice<MemberLossPolicy>(
            v, q, {{"fail", MemberLossPolicy::kFail}, {"continue", MemberLossPolicy::kContinue}});
      }},
      {"on_missing_at_start", [&](N v, P q) {
        c.publisher.on_missing_at_start = L.choice<MissingAtStartPolicy>(
            v, q, {{"fail", MissingAtStartPolicy::kFail}, {"start_with_present", MissingAtStartPolicy::kStartWithPresent}});
      }},
      {"update_timeout", [&](N v, P q) { c.publisher.update_timeout = L.duration(v, q); }},
      {"plan_timeout", [&](N v, P q) { c.publisher.plan_timeout = L.duration(v, q); }},
      {"quarantine_backoff", [&](N v, P q) { c.publisher.quarantine_backoff = L.duration(v, q); }},
      {"apply_timeout", [&](N v, P q) {  // auto (0): trainer_side/apply_deadline.h
        c.publisher.apply_timeout = v.IsScalar() && v.Scalar() == "auto" ? Millis{0} : L.duration(v, q);
      }},
      {"on_slow_member", [&](N v, P q) {
        c.publisher.on_slow_member =
            L.choice<SlowMemberPolicy>(v, q, {{"wait", SlowMemberPolicy::kWait}, {"shed", SlowMemberPolicy::kShed}});
      }},
      {"slow_member_floor", [&](N v, P q) { c.publisher.slow_member_floor = L.size(v, q, 1); }},
      {"slow_member_window", [&](N v, P q) { c.publisher.slow_member_window = L.duration(v, q); }},
      {"reuse_validated_plan", [&](N v, P q) { c.publisher.reuse_validated_plan = L.boolean(v, q); }},
      {"transforms", [&](N v, P q) {
        if (!v.IsSequence()) L.fail(v, q, "expected a list of rules like {match: \"*.weight\", fp8: block}");
        c.publisher.transforms.clear();
        for (size_t i = 0; i < v.size(); ++i) {
          const std::string qi = q + "[" + std::to_string(i) + "]";
          transform::Rule rule;
          rule.where = L.where(v[i]) + " " + qi;
          L.map(v[i], qi, {
            {"match", [&](N m, P mq) { rule.match = L.scalar(m, mq, "a glob over tensor names"); }},
            {"cast", [&](N m, P mq) {
              rule.cast = L.choice<DType>(m, mq, {{"bf16", DType::kBF16}, {"fp16", DType::kF16}, {"fp32", DType::kF32}});
            }},
            {"fp8", [&](N m, P mq) {
              rule.fp8 = L.choice<transform::Fp8Scaling>(m, mq, {{"block", transform::Fp8Scaling::kBlock},
                                                                {"channel", transform::Fp8Scaling::kChannel},
                                                                {"tensor", transform::Fp8Scaling::kTensor}});
            }},
            {"keep", [&](N m, P mq) { rule.keep = L.boolean(m, mq); }},
          });
          if (rule.match.empty()) L.fail(v[i], qi, "a rule needs match (a glob over tensor names, e.g. \"*.weight\")");
          const int kinds = (rule.cast ? 1 : 0) + (rule.fp8 ? 1 : 0) + (rule.keep ? 1 : 0);
          if (kinds != 1) L.fail(v[i], qi, "a rule gives exactly one of cast, fp8 or keep: true");
          c.publisher.transforms.push_back(std::move(rule));
        }
      }},
      {"delta", [&](N v, P q) {
        auto mode = [&](N m, P mq) {
          c.publisher.delta = L.choice<DeltaMode>(
              m, mq, {{"off", DeltaMode::kOff}, {"auto", DeltaMode::kAuto}, {"always", DeltaMode::kAlways}});
        };
        if (!v.IsMap()) return mode(v, q);
        L.map(v, q, {
          {"mode", mode},
          {"baseline", [&](N b, P bq) {
            c.publisher.delta_baseline =
                L.choice<DeltaBaseline>(b, bq, {{"host", DeltaBaseline::kHost}, {"device", DeltaBaseline::kDevice}});
          }},
        });
      }},
    });
}

void parse_subscriber(const Loader& L, const YAML::Node& n, const std::string& p, Config& c) {
  using N = const YAML::Node&;
  using P = const std::string&;
    L.map(n, p, {
      {"device", [&](N v, P q) { c.subscriber.devices = {L.device(v, q)}; }},
      {"devices", [&](N v, P q) {
        if (!v.IsSequence() || v.size() == 0) L.fail(v, q, "expected a non-empty list of devices");
        c.subscriber.devices.clear();
        for (size_t i = 0; i < v.size(); ++i)
          c.subscriber.devices.push_back(L.device(v[i], q + "[" + std::to_string(i) + "]"));
      }},
      {"delta_baseline", [&](N v, P q) {
        c.subscriber.delta_baseline = L.choice<bool>(v, q, {{"none", false}, {"host", true}});
      }},
    });
}

void parse_trainer(const Loader& L, const YAML::Node& n, const std::string& p, Config& c) {
  using N = const YAML::Node&;
  using P = const std::string&;
    L.map(n, p, {
      {"model_size", [&](N v, P q) { c.trainer.model_bytes = L.size(v, q, 1); }},
      {"layers", [&](N v, P q) { c.trainer.layers = static_cast<int>(L.integer(v, q, 0, 100000)); }},
      {"dtype", [&](N v, P q) {
        std::string s = L.scalar(v, q, "a dtype");
        auto d = parse_dtype(s);
        if (!d) L.fail(v, q, "bad value '" + s + "': expected a safetensors dtype (F32, F16, BF16, F8_E4M3, F8_E5M2, I8, U8, I16, I32, I64, BOOL, F64)");
        c.trainer.dtype = *d;
      }},
      {"updates", [&](N v, P q) { c.trainer.updates = static_cast<int>(L.integer(v, q, 1, 1000000)); }},
      {"interval", [&](N v, P q) { c.trainer.interval = L.duration(v, q, /*allow_zero=*/true); }},
      {"seed", [&](N v, P q) { c.trainer.seed = static_cast<uint64_t>(L.integer(v, q, 0, INT64_MAX)); }},
      {"changes", [&](N v, P q) {
        c.trainer.changes = L.choice<ModelChanges>(v, q, {{"every", ModelChanges::kEvery}, {"uneven", ModelChanges::kUneven}});
      }},
    });
}

void parse_logging(const Loader& L, const YAML::Node& n, const std::string& p, Config& c) {
  using N = const YAML::Node&;
  using P = const std::string&;
    L.map(n, p, {
      {"level", [&](N v, P q) {
        c.log_level = L.choice<LogLevel>(v, q, {{"debug", LogLevel::kDebug}, {"info", LogLevel::kInfo},
                                                {"warn", LogLevel::kWarn}, {"error", LogLevel::kError},
                                                {"off", LogLevel::kOff}});
      }},
      {"format", [&](N v, P q) {
        c.log_format = L.choice<LogFormat>(v, q, {{"text", LogFormat::kText}, {"json", LogFormat::kJson}});
      }},
    });
}

void parse_metrics(const Loader& L, const YAML::Node& n, const std::string& p, Config& c) {
  using N = const YAML::Node&;
  using P = const std::string&;
    L.map(n, p, {
      {"listen", [&](N v, P q) {
        const std::string s = L.scalar(v, q, "HOST:PORT");
        const size_t colon = s.rfind(':');
        std::string host = colon == std::string::npos ? "" : s.substr(0, colon);
        const std::string port = colon == std::string::npos ? s : s.substr(colon + 1);
        if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
        else if (host.find(':') != std::string::npos)
          L.fail(v, q, "bad value '" + s + "': an IPv6 address goes in brackets, as [::1]:9464");
        char* end = nullptr;
        const long value = port.empty() ? -1 : std::strtol(port.c_str(), &end, 10);
        if (port.empty() || *end != '\0' || value < 0 || value > 65535)
          L.fail(v, q, "bad value '" + s + "': expected HOST:PORT, :PORT or PORT with a port in [0, 65535]");
        if (host.find_first_of(" /\t") != std::string::npos || host.size() > 253)
          L.fail(v, q, "bad value '" + s + "': '" + host + "' is not a host name or address");
        c.metrics.listen_host = host.empty() ? "127.0.0.1" : host;
        c.metrics.listen_port = static_cast<int>(value);
      }},
    });
}

// Checks that span sections.
void check_cross_fields(const Loader& L, const YAML::Node& root, const Config& c) {
  check_auth_for_endpoint(L, root, c);
  const auto& dev = c.subscriber.devices;
  if (dev.size() > 1 && static_cast<int>(dev.size()) != c.publisher.subscriber_count)
    L.fail(root["subscriber"]["devices"], "subscriber.devices",
           "lists " + std::to_string(dev.size()) + " devices for " + std::to_string(c.publisher.subscriber_count) +
               " subscribers: give one device for all, or one per subscriber");
  const bool any_cuda = c.publisher.device.is_cuda() ||
                        std::any_of(dev.begin(), dev.end(), [](const Device& d) { return d.is_cuda(); });
  const bool all_cuda = c.publisher.device.is_cuda() &&
                        std::all_of(dev.begin(), dev.end(), [](const Device& d) { return d.is_cuda(); });
  if (c.data_plane.backend == Backend::kGloo && any_cuda)
    L.fail(root["data_plane"].IsDefined() ? root["data_plane"] : root, "data_plane.backend",
           "backend gloo moves host memory, but a cuda device is configured: use backend nccl or cpu devices");
  if (c.data_plane.backend == Backend::kShm && any_cuda && !all_cuda)
    L.fail(root["data_plane"].IsDefined() ? root["data_plane"] : root, "data_plane.backend",
           "backend shm moves host memory or CUDA memory, not both: make publisher.device and every subscriber "
           "device cpu, or every one cuda");
  if (c.data_plane.local && c.data_plane.backend != Backend::kGloo)
    L.fail(root["data_plane"]["local"], "data_plane.local",
           std::string("auto needs backend gloo (with backend ") + backend_name(c.data_plane.backend) +
               ": shm already is local; engines on the trainer's GPU use backend shm with cuda devices)");
  if (c.publisher.on_slow_member == SlowMemberPolicy::kShed && c.publisher.slow_member_floor == 0)
    L.fail(root["publisher"]["on_slow_member"], "publisher.on_slow_member",
           "shed needs publisher.slow_member_floor (the rate, in bytes per second, below which a member is shed, "
           "e.g. 8MiB)");
  if (c.publisher.on_slow_member == SlowMemberPolicy::kShed && c.data_plane.backend != Backend::kGloo)
    L.fail(root["publisher"]["on_slow_member"], "publisher.on_slow_member",
           std::string("shed needs backend gloo (it measures each link; backend ") +
               backend_name(c.data_plane.backend) + " does not)");
  if (c.data_plane.backend == Backend::kNccl && !any_cuda)
    L.fail(root["data_plane"].IsDefined() ? root["data_plane"] : root, "data_plane.backend",
           "backend nccl needs cuda devices for publisher.device and subscriber.device(s)");
  if (!c.publisher.transforms.empty() && c.publisher.device.is_cuda())
    L.fail(root["publisher"]["transforms"], "publisher.transforms",
           "publisher.device is " + c.publisher.device.to_string() + ": " + transform::kCudaPending);
}

Config parse(const YAML::Node& root, const std::string& file) {
  Loader L(file);
  Config c;
  c.source = file;
  if (root.IsNull() || !root.IsDefined()) return c;
  using N = const YAML::Node&;
  using P = const std::string&;
  L.map(root, "", {
    {"control", [&](N n, P p) { parse_control(L, n, p, c); }},
    {"data_plane", [&](N n, P p) { parse_data_plane(L, n, p, c); }},
    {"publisher", [&](N n, P p) { parse_publisher(L, n, p, c); }},
    {"subscriber", [&](N n, P p) { parse_subscriber(L, n, p, c); }},
    {"trainer", [&](N n, P p) { parse_trainer(L, n, p, c); }},
    {"auth", [&](N n, P p) { parse_auth(L, n, p, file, c.auth); }},
    {"logging", [&](N n, P p) { parse_logging(L, n, p, c); }},
    {"metrics", [&](N n, P p) { parse_metrics(L, n, p, c); }},
  });
  check_cross_fields(L, root, c);
  return c;
}

}  // namespace

std::vector<std::string> Config::worker_ids() const {
  if (!publisher.subscriber_ids.empty()) return publisher.subscriber_ids;
  std::vector<std::string> ids;
  for (int i = 1; i <= publisher.subscriber_count; ++i) ids.push_back("worker-" + std::to_string(i));
  return ids;
}

int Config::expected_count() const { return publisher.subscriber_count; }

Device Config::device_for_worker(const std::string& id) const {
  if (subscriber.devices.size() <= 1) return subscriber.devices.empty() ? Device::cpu() : subscriber.devices[0];
  const auto ids = worker_ids();
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] == id && i < subscriber.devices.size()) return subscriber.devices[i];
  return subscriber.devices[0];
}

StatusOr<Config> load_config_string(const std::string& yaml, const std::string& name) {
  try {
    YAML::Node root = YAML::Load(yaml);
    return parse(root, name);
  } catch (const ConfigError& e) {
    return invalid_argument(e.message);
  } catch (const YAML::Exception& e) {
    std::ostringstream os;
    os << name << ":" << e.mark.line + 1 << ":" << e.mark.column + 1 << ": YAML syntax error: " << e.msg;
    return invalid_argument(os.str());
  }
}

StatusOr<Config> load_config_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return invalid_argument(path + ": cannot open config file");
  std::stringstream ss;
  ss << in.rdbuf();
  return load_config_string(ss.str(), path);
}

}  // namespace paramcast
