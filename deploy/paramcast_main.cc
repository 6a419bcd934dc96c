// paramcast: operator commands.
//   paramcast launch FILE.yaml   run every role of a single-host deployment
//   paramcast status ENDPOINT    ask a running publisher for its members
//   paramcast keygen NAME...     write CURVE key pairs (docs/security.md)
//   paramcast [COMMAND] --help   usage
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "common/cli.h"
#include "common/config.h"
#include "common/control/auth.h"
#include "common/control/log_guard.h"
#include "common/control/messages.h"
#include "common/units.h"

using namespace paramcast;

namespace {

const Tool kMain{
    .name = "paramcast",
    .usage = "usage: paramcast COMMAND [ARGS...]\n"
             "\n"
             "commands:\n"
             "  launch FILE.yaml                      run every role of a single-host deployment\n"
             "  status [tcp://HOST:PORT] [--config FILE.yaml] [--key FILE] [--json] [--timeout 2s]\n"
             "                                        members, ranks, epoch, versions of a publisher\n"
             "  keygen NAME... [--dir DIR]            write CURVE key pairs DIR/NAME.key and DIR/NAME.pub\n"
             "\n"
             "  -h, --help  print this and exit; `paramcast COMMAND --help` describes one command\n",
    // Every command's flags, to find the command among them (see main).
    .value_flags = {"timeout", "config", "key", "dir"},
    .bool_flags = {"json"},
};

const Tool kKeygen{
    .name = "paramcast keygen",
    .usage = "usage: paramcast keygen NAME... [--dir DIR]\n"
             "\n"
             "Writes one CURVE key pair per NAME: DIR/NAME.key (public and secret half,\n"
             "mode 0600; give it only to the process that is NAME) and DIR/NAME.pub (public\n"
             "half). Existing files are never overwritten. Prints one line \"NAME PUBLIC-KEY\"\n"
             "per pair, the format of auth.authorized_keys and auth.status_keys.\n"
             "Typical: paramcast keygen --dir keys publisher worker-1 worker-2 status\n"
             "\n"
             "  --dir DIR   where to write the files (default: the current directory; created)\n"
             "  -h, --help  print this and exit\n",
    .value_flags = {"dir"},
};

const Tool kLaunch{
    .name = "paramcast launch",
    .usage = "usage: paramcast launch FILE.yaml\n"
             "\n"
             "Runs every role of the single-host deployment FILE.yaml: one paramcast-trainer\n"
             "and one paramcast-worker per worker, with their output prefixed by role. When\n"
             "one role fails (or on Ctrl-C) it stops every role. Exit 0 when all succeeded.\n"
             "\n"
             "  -h, --help  print this and exit\n",
};

const Tool kStatus{
    .name = "paramcast status",
    .usage = "usage: paramcast status [tcp://HOST:PORT] [--config FILE.yaml] [--key FILE] [--json] [--timeout 2s]\n"
             "\n"
             "Asks the publisher at tcp://HOST:PORT for its members: rank, weight version,\n"
             "state, heartbeat age, device, host and pid of each, and the group's epoch.\n"
             "With auth.mode curve the publisher answers only an authorized key.\n"
             "\n"
             "  --config FILE   deployment file: its endpoint (unless given) and auth block\n"
             "  --key FILE      key pair to authenticate with (default: auth.status_key)\n"
             "  --json          one JSON object instead of a table\n"
             "  --timeout DUR   how long to wait for an answer (default 2s)\n"
             "  -h, --help      print this and exit\n",
    .value_flags = {"timeout", "config", "key"},
    .bool_flags = {"json"},
};

std::string self_dir() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  buf[n] = 0;
  std::string p(buf);
  return p.substr(0, p.rfind('/'));
}

struct Child {
  std::string role;
  pid_t pid = -1;
  int fd = -1;
  std::string partial;
  std::string summary;  // the trainer's closing line: updates, bytes, GB/s
  bool done = false;
  int status = 0;
};

volatile sig_atomic_t g_interrupted = 0;
void on_signal(int) { g_interrupted = 1; }

Child spawn(const std::string& role, const std::vector<std::string>& args) {
  int fds[2];
  if (pipe(fds) != 0) return {};
  Child c;
  c.role = role;
  c.pid = fork();
  if (c.pid == 0) {
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    close(fds[0]);
    close(fds[1]);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    std::fprintf(stderr, "cannot exec %s: %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  close(fds[1]);
  c.fd = fds[0];
  return c;
}

void pump(Child& c, bool flush) {
  char buf[65536];
  for (;;) {
    ssize_t n = read(c.fd, buf, sizeof buf);
    if (n <= 0) break;
    c.partial.append(buf, static_cast<size_t>(n));
    if (n < static_cast<ssize_t>(sizeof buf)) break;
  }
  size_t pos;
  while ((pos = c.partial.find('\n')) != std::string::npos) {
    const std::string line = c.partial.substr(0, pos);
    if (line.rfind("paramcast-trainer: ", 0) == 0 && line.find(" updates, ") != std::string::npos)
      c.summary = line.substr(19);
    std::printf("[%-9s] %s\n", c.role.c_str(), line.c_str());
    c.partial.erase(0, pos + 1);
  }
  if (flush && !c.partial.empty()) {
    std::printf("[%-9s] %s\n", c.role.c_str(), c.partial.c_str());
    c.partial.clear();
  }
  std::fflush(stdout);
}

// Waits (30 s at most) for the trainer to write the endpoint it bound;
// "" when it exited or never did.
std::string wait_for_endpoint(Child& trainer, const std::string& endpoint_file) {
  std::string endpoint;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (endpoint.empty() && std::chrono::steady_clock::now() < deadline && !g_interrupted) {
    pump(trainer, false);
    std::ifstream in(endpoint_file);
    std::getline(in, endpoint);
    int st;
    if (waitpid(trainer.pid, &st, WNOHANG) == trainer.pid) {
      trainer.done = true;
      trainer.status = st;
      break;
    }
    if (endpoint.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return endpoint;
}

// Relays every role's output until all have exited. The first role that
// fails (or an interrupt) stops the others: SIGTERM, then SIGKILL after 5 s.
// Returns 1 when a role failed or launch was interrupted.
int supervise(std::vector<Child>& children, bool stopping) {
  int failed = stopping ? 1 : 0;
  auto stop_deadline = std::chrono::steady_clock::now();
  auto stop_all = [&](int sig) {
    for (auto& c : children)
      if (!c.done && c.pid > 0) kill(c.pid, sig);
  };
  auto begin_stop = [&](const std::string& why) {
    std::printf("[launch   ] %s; stopping every role\n", why.c_str());
    failed = 1;
    stopping = true;
    stop_all(SIGTERM);
    stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  };
  if (stopping) stop_all(SIGTERM);
  for (bool all_done = false; !all_done;) {
    std::vector<pollfd> pfds;
    for (auto& c : children) pfds.push_back({c.fd, POLLIN, 0});
    poll(pfds.data(), pfds.size(), 100);
    all_done = true;
    for (auto& c : children) {
      pump(c, false);
      int st;
      if (!c.done && waitpid(c.pid, &st, WNOHANG) == c.pid) {
        c.done = true;
        c.status = st;
        pump(c, true);
        const bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
        if (!ok && !stopping)
          begin_stop(c.role + " failed (" + (WIFEXITED(st) ? "exit " : "signal ") +
                     std::to_string(WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st)) + ")");
      }
      all_done = all_done && c.done;
    }
    if (g_interrupted && !stopping) begin_stop("interrupted");
    if (stopping && std::chrono::steady_clock::now() > stop_deadline) stop_all(SIGKILL);
  }
  return failed;
}

int launch(const Flags& flags) {
  if (flags.positional.size() < 2) return usage_error(kLaunch, "missing FILE.yaml");
  if (flags.positional.size() > 2) return usage_error(kLaunch, "unexpected argument '" + flags.positional[2] + "'");
  const std::string file = flags.positional[1];
  auto cfg = load_config_file(file);
  if (!cfg.ok()) {
    std::fprintf(stderr, "paramcast launch: %s\n", cfg.status().message().c_str());
    return 2;
  }
  const std::string dir = self_dir();
  char tmpl[] = "/tmp/paramcast-launch-XXXXXX";
  const std::string tmp = mkdtemp(tmpl) ? tmpl : "/tmp";
  const std::string endpoint_file = tmp + "/endpoint";
  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
  signal(SIGPIPE, SIG_IGN);

  if (isatty(1)) setenv("PARAMCAST_PROGRESS", "1", 1);  // the trainer reports long updates
  std::vector<Child> children;
  children.push_back(spawn("trainer", {dir + "/paramcast-trainer", "--config", file, "--endpoint-file", endpoint_file}));
  // Workers connect to the endpoint the trainer actually bound (it may be "*").
  const std::string endpoint = wait_for_endpoint(children[0], endpoint_file);
  if (!endpoint.empty())
    for (const auto& id : cfg->worker_ids())
      children.push_back(spawn(id, {dir + "/paramcast-worker", "--config", file, "--id", id, "--endpoint", endpoint}));
  const int failed = supervise(children, endpoint.empty());
  for (auto& c : children) close(c.fd);
  std::remove(endpoint_file.c_str());
  rmdir(tmp.c_str());
  std::printf("[launch   ] %s: %zu roles, %s%s%s\n", file.c_str(), children.size(), failed ? "FAILED" : "all succeeded",
              children[0].summary.empty() ? "" : "; ", children[0].summary.c_str());
  return failed;
}

int keygen(const Flags& flags) {
  if (flags.positional.size() < 2) return usage_error(kKeygen, "missing NAME");
  const std::string dir = flags.get("dir", ".");
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    std::fprintf(stderr, "paramcast keygen: cannot create %s: %s\n", dir.c_str(), std::strerror(errno));
    return 1;
  }
  for (size_t i = 1; i < flags.positional.size(); ++i) {
    const std::string& name = flags.positional[i];
    if (name != "publisher" && name != "status" && !valid_worker_id(name))
      return usage_error(kKeygen, "'" + name + "' is not a worker id (1-64 of [A-Za-z0-9._-]), publisher or status");
    auto keys = control::generate_key_pair();
    Status st = keys.ok() ? control::write_key_pair(dir + "/" + name, *keys) : keys.status();
    if (!st.ok()) {
      std::fprintf(stderr, "paramcast keygen: %s\n", st.message().c_str());
      return 1;
    }
    std::printf("%s %s\n", name.c_str(), keys->public_key.c_str());
  }
  return 0;
}

// A member's receive figures: the update it is receiving now, else its last
// one; each rate labelled (what it received over the time it took, and its
// inbound link's rate while it had bytes waiting).
std::string transfer_column(proto::MemberStatus::Reader m) {
  auto rate = [](uint64_t bytes, uint64_t ms) {
    return ms ? "received at " + format_rate(static_cast<double>(bytes) * 1000 / static_cast<double>(ms))
              : std::string("-");
  };
  if (m.getReceivingVersion())
    return "receiving v" + std::to_string(m.getReceivingVersion()) + ": " + format_bytes(m.getReceivedBytes()) + " in " +
           format_duration(std::chrono::milliseconds(m.getReceivingForMs())) + ", " +
           rate(m.getReceivedBytes(), m.getReceivingForMs());
  if (!m.getLastUpdateVersion()) return "-";
  return "v" + std::to_string(m.getLastUpdateVersion()) + (m.getLastUpdateOk() ? " applied: " : " failed: ") +
         format_bytes(m.getLastUpdateBytes()) + " in " + format_duration(std::chrono::milliseconds(m.getLastUpdateMs())) +
         ", " + rate(m.getLastUpdateBytes(), m.getLastUpdateMs()) +
         (m.getLastUpdateLinkRate() ? ", link " + format_rate(static_cast<double>(m.getLastUpdateLinkRate())) : "");
}

void print_status_json(const std::string& endpoint, proto::StatusReply::Reader r) {
  std::printf("{\"endpoint\":\"%s\",\"epoch\":%llu,\"published_version\":%llu,\"expected\":%u,\"backend\":\"%s\","
              "\"delta\":{\"mode\":\"%s\",\"baseline_bytes\":%llu,\"baseline_version\":%llu,\"last_bytes\":%llu,"
              "\"last_wire_bytes\":%llu},\"members\":[",
              endpoint.c_str(), static_cast<unsigned long long>(r.getEpoch()),
              static_cast<unsigned long long>(r.getPublishedVersion()), r.getExpected(),
              backend_name(backend_from_wire(static_cast<int>(r.getBackend()))), control::printable(r.getDelta().cStr()).c_str(),
              static_cast<unsigned long long>(r.getBaselineBytes()), static_cast<unsigned long long>(r.getBaselineVersion()),
              static_cast<unsigned long long>(r.getLastBytes()), static_cast<unsigned long long>(r.getLastWireBytes()));
  bool first = true;
  for (auto m : r.getMembers()) {
    std::printf("%s{\"id\":\"%s\",\"rank\":%d,\"version\":%llu,\"state\":\"%s\",\"heartbeat_age_ms\":%llu,"
                "\"host\":\"%s\",\"pid\":%u,\"device\":\"%s\",\"lost\":%s,"
                "\"receiving_version\":%llu,\"received_bytes\":%llu,\"receiving_for_ms\":%llu,"
                "\"last_update\":{\"version\":%llu,\"ok\":%s,\"bytes\":%llu,\"ms\":%llu,\"link_rate\":%llu}}",
                first ? "" : ",", control::printable(m.getWorkerId().cStr()).c_str(), m.getRank(),
                static_cast<unsigned long long>(m.getWeightVersion()), control::state_name(m.getState()),
                static_cast<unsigned long long>(m.getLastHeartbeatAgeMs()), control::printable(m.getHost().cStr()).c_str(),
                m.getPid(), control::get_device(m.getDevice()).to_string().c_str(), m.getLost() ? "true" : "false",
                static_cast<unsigned long long>(m.getReceivingVersion()),
                static_cast<unsigned long long>(m.getReceivedBytes()),
                static_cast<unsigned long long>(m.getReceivingForMs()),
                static_cast<unsigned long long>(m.getLastUpdateVersion()), m.getLastUpdateOk() ? "true" : "false",
                static_cast<unsigned long long>(m.getLastUpdateBytes()),
                static_cast<unsigned long long>(m.getLastUpdateMs()),
                static_cast<unsigned long long>(m.getLastUpdateLinkRate()));
    first = false;
  }
  std::printf("]}\n");
}

void print_status_table(const std::string& endpoint, proto::StatusReply::Reader r) {
  std::printf("publisher %s  epoch %llu  published v%llu  %u expected  backend %s\n", endpoint.c_str(),
              static_cast<unsigned long long>(r.getEpoch()), static_cast<unsigned long long>(r.getPublishedVersion()),
              r.getExpected(), backend_name(backend_from_wire(static_cast<int>(r.getBackend()))));
  std::printf("delta %s  baseline %s (v%llu)  last update %s, %s on the wire\n",
              control::printable(r.getDelta().cStr()).c_str(), format_bytes(r.getBaselineBytes()).c_str(),
              static_cast<unsigned long long>(r.getBaselineVersion()), format_bytes(r.getLastBytes()).c_str(),
              format_bytes(r.getLastWireBytes()).c_str());
  std::printf("%-16s %5s %8s %-11s %10s  %-8s %-24s %s\n", "WORKER", "RANK", "VERSION", "STATE", "HEARTBEAT", "DEVICE",
              "HOST/PID", "TRANSFER");
  for (auto m : r.getMembers()) {
    char age[32];
    std::snprintf(age, sizeof age, "%llums ago", static_cast<unsigned long long>(m.getLastHeartbeatAgeMs()));
    const std::string host = control::printable(m.getHost().cStr()) + "/" + std::to_string(m.getPid());
    std::printf("%-16s %5s %8llu %-11s %10s  %-8s %-24s %s\n", control::printable(m.getWorkerId().cStr()).c_str(),
                m.getLost() ? "lost" : m.getRank() < 0 ? "-" : std::to_string(m.getRank()).c_str(),
                static_cast<unsigned long long>(m.getWeightVersion()), control::state_name(m.getState()), age,
                control::get_device(m.getDevice()).to_string().c_str(), host.c_str(), transfer_column(m).c_str());
  }
}

int status(const Flags& flags) {
  if (flags.positional.size() > 2) return usage_error(kStatus, "unexpected argument '" + flags.positional[2] + "'");
  Config cfg;
  if (flags.has("config")) {
    auto loaded = load_config_file(flags.get("config"));
    if (!loaded.ok()) {
      std::fprintf(stderr, "paramcast status: %s\n", loaded.status().message().c_str());
      return 2;
    }
    cfg = *loaded;
  }
  if (flags.positional.size() < 2 && !flags.has("config"))
    return usage_error(kStatus, "missing tcp://HOST:PORT (or --config FILE.yaml)");
  const std::string endpoint = flags.positional.size() >= 2 ? flags.positional[1] : cfg.control.endpoint;
  auto timeout = parse_duration(flags.get("timeout", "2s")).value_or(std::chrono::seconds(2));
  auto auth = control::client_auth(cfg.auth, "status", flags.get("key", cfg.auth.status_key));
  if (!auth.ok()) {
    std::fprintf(stderr, "paramcast status: %s\n", auth.status().message().c_str());
    return 2;
  }
  zmq::context_t ctx;
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  control::apply_client_auth(s, *auth);
  s.set(zmq::sockopt::routing_id, "status-" + std::to_string(getpid()));
  s.set(zmq::sockopt::linger, 0);
  s.connect(endpoint);
  // Test hook: the request goes out this long after connect, so a test can
  // make the publisher refuse the handshake first (see below).
  if (const char* ms = std::getenv("PARAMCAST_FAULT_STATUS_SEND_AFTER_MS"))
    std::this_thread::sleep_for(std::chrono::milliseconds(std::strtoull(ms, nullptr, 10)));
  // Never a blocking send: a publisher that refuses our key (CURVE) ends the
  // connection's pipe, and a DEALER without a pipe blocks a send forever. A
  // request that cannot be queued is tried again until the deadline.
  zmq::message_t request =
      control::make_message(0, control::new_incarnation(), [](auto b) { b.initStatusRequest().setRequestId(1); });
  bool sent = false;
  zmq::pollitem_t items[] = {{s.handle(), 0, ZMQ_POLLIN, 0}};
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (!sent) {
      zmq::message_t copy;
      copy.copy(request);
      sent = s.send(copy, zmq::send_flags::dontwait).has_value();
    }
    zmq::poll(items, 1, std::chrono::milliseconds(50));
    if (!(items[0].revents & ZMQ_POLLIN)) continue;
    zmq::message_t msg;
    (void)s.recv(msg, zmq::recv_flags::none);
    auto d = control::decode(msg.data(), msg.size(), control::DecodeLimits{});
    if (!d.ok() || d.value()->envelope().getBody().which() != proto::Envelope::Body::STATUS_REPLY) continue;
    auto r = d.value()->envelope().getBody().getStatusReply();
    if (flags.has("json")) print_status_json(endpoint, r);
    else print_status_table(endpoint, r);
    return 0;
  }
  std::fprintf(stderr, "paramcast status: no answer from %s within %s\n", endpoint.c_str(),
               format_duration(timeout).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // The command is the first argument that is not a flag (flags may come
  // before it); then the command's own Tool checks the flags.
  const Flags any = parse_flags(argc, argv, 1, kMain);
  const std::string cmd = any.positional.empty() ? "" : any.positional[0];
  if (cmd == "launch" || cmd == "status" || cmd == "keygen") {
    const Tool& tool = cmd == "launch" ? kLaunch : cmd == "status" ? kStatus : kKeygen;
    const Flags flags = parse_flags(argc, argv, 1, tool);
    if (auto code = finish_flags(flags, tool)) return *code;
    return cmd == "launch" ? launch(flags) : cmd == "status" ? status(flags) : keygen(flags);
  }
  if (auto code = finish_flags(any, kMain)) return *code;
  return usage_error(kMain, cmd.empty() ? "missing COMMAND" : "unknown command '" + cmd + "'");
}
