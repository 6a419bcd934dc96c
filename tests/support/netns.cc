#include "tests/support/netns.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace paramcast::test {
namespace {

std::string capture(const std::string& command) {
  std::string out;
  if (FILE* f = ::popen((command + " 2>&1").c_str(), "r")) {
    char buf[512];
    while (size_t n = std::fread(buf, 1, sizeof(buf), f)) out.append(buf, n);
    ::pclose(f);
  }
  return out;
}

}  // namespace

bool NetworkLab::sh(const std::string& command) { return std::system((command + " >/dev/null 2>&1").c_str()) == 0; }

std::unique_ptr<NetworkLab> NetworkLab::create(int nodes, std::string* why) {
  if (::geteuid() != 0) {
    *why = "network namespaces need root (euid " + std::to_string(::geteuid()) + ")";
    return nullptr;
  }
  for (const char* tool : {"ip", "tc", "bridge"})
    if (!sh(std::string("command -v ") + tool)) {
      *why = std::string("iproute2's '") + tool + "' is not installed";
      return nullptr;
    }
  std::unique_ptr<NetworkLab> lab(new NetworkLab());
  static std::atomic<unsigned> counter{0};
  char tag[16];
  std::snprintf(tag, sizeof(tag), "%04x%x", static_cast<unsigned>(::getpid()) & 0xffff, counter++ & 0xf);
  lab->tag_ = std::string("pcv") + tag;
  lab->bridge_ = std::string("pcb") + tag;
  if (!lab->build(nodes)) {
    *why = "could not build namespaces joined by veth and a bridge: " +
           capture("ip netns add " + lab->tag_ + "-probe && ip netns del " + lab->tag_ + "-probe");
    return nullptr;  // the destructor removed what was made
  }
  return lab;
}

bool NetworkLab::build(int nodes) {
  if (!sh("ip link add " + bridge_ + " type bridge && ip link set " + bridge_ + " up")) return false;
  for (int i = 0; i < nodes; ++i) {
    const std::string ns = "paramcast-" + tag_.substr(3) + "-" + std::to_string(i);
    if (!sh("ip netns add " + ns)) return false;
    namespaces_.push_back(ns);
    const std::string in = "ip -n " + ns + " ";
    if (!sh("ip link add " + port(i) + " type veth peer name " + kInterface + " netns " + ns) ||
        !sh("ip link set " + port(i) + " master " + bridge_ + " && ip link set " + port(i) + " up") ||
        !sh(in + "addr add " + address(i) + "/24 dev " + kInterface) || !sh(in + "link set " + kInterface + " up") ||
        !sh(in + "link set lo up"))
      return false;
  }
  return true;
}

NetworkLab::~NetworkLab() {
  // Deleting a namespace deletes its veth end, and with it the host end.
  for (const auto& ns : namespaces_) sh("ip netns del " + ns);
  for (size_t i = 0; i < namespaces_.size() + 1; ++i) sh("ip link del " + port(static_cast<int>(i)));
  if (!bridge_.empty()) sh("ip link del " + bridge_);
}

std::string NetworkLab::exec_path() const {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"})
    if (::access(p, X_OK) == 0) return p;
  return "ip";
}

std::vector<std::string> NetworkLab::exec_args(int node, const std::string& program,
                                               const std::vector<std::string>& args) const {
  std::vector<std::string> v = {"netns", "exec", ns(node), program};
  v.insert(v.end(), args.begin(), args.end());
  return v;
}

bool NetworkLab::link_up(int node) {
  const std::string host = capture("ip link show " + port(node));
  const std::string inside = capture("ip -n " + ns(node) + " link show " + kInterface);
  return host.find("LOWER_UP") != std::string::npos && inside.find("LOWER_UP") != std::string::npos;
}

}  // namespace paramcast::test
