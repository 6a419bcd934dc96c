// Test support: a small network of Linux network namespaces, one per node,
// each joined to one bridge by a veth pair, so that tests can start the
// trainer and every worker on its own network stack (`ip netns exec`) and
// break the network between them for real.
//
//   node i: namespace paramcast-<tag>-<i>, interface "pc0" at 10.77.0.<i+1>/24
//   host:   bridge pcb<tag>, veth pcv<tag>-<i> (the node's port on the bridge)
//
// Faults, all on the host side of a node's veth:
//   cut(i)    `ip link set ... down`: the link goes down, both ends fall silent
//   block(i)  the bridge port is disabled: frames are dropped, links stay up
//   shape(i)  a token-bucket rate limit on frames towards the node (tc tbf)
//   throttle_data(i, port, rate)  every TCP segment towards the node except
//             those from `port` (the control endpoint) is limited to `rate`
//             (tc htb + u32): the data plane slows, the control plane does not
//   starve(i, port)  the same at 8 bit/s: the data plane stops, the control
//             plane and the link stay up
// Each has its undo (heal, unblock, unshape).
//
// The tag is unique per process and lab, so parallel or repeated runs never
// collide; the destructor deletes every namespace, veth and the bridge, also
// when a test fails. Needs root and iproute2 (`ip`, `tc`, `bridge`).
// Thread-safety: none; one test thread drives a lab.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace paramcast::test {

class NetworkLab {
 public:
  static constexpr const char* kInterface = "pc0";

  // Builds a lab of `nodes` namespaces; null with `why` set where this machine
  // cannot (not root, no iproute2, namespaces refused).
  static std::unique_ptr<NetworkLab> create(int nodes, std::string* why);
  ~NetworkLab();
  NetworkLab(const NetworkLab&) = delete;
  NetworkLab& operator=(const NetworkLab&) = delete;

  const std::string& ns(int node) const { return namespaces_.at(node); }
  std::string address(int node) const { return "10.77.0." + std::to_string(node + 1); }
  // The path and leading arguments that run a command inside `node`'s namespace.
  std::string exec_path() const;
  std::vector<std::string> exec_args(int node, const std::string& program, const std::vector<std::string>& args) const;

  bool cut(int node) { return sh("ip link set " + port(node) + " down"); }
  bool heal(int node) { return sh("ip link set " + port(node) + " up"); }
  bool block(int node) { return sh("bridge link set dev " + port(node) + " state 0"); }
  bool unblock(int node) { return sh("bridge link set dev " + port(node) + " state 3"); }
  bool shape(int node, const std::string& rate) {
    return sh("tc qdisc replace dev " + port(node) + " root tbf rate " + rate + " burst 32kb latency 400ms");
  }
  bool unshape(int node) { return sh("tc qdisc del dev " + port(node) + " root"); }
  bool throttle_data(int node, int keep_port, const std::string& rate) {
    const std::string dev = " dev " + port(node) + " ";
    return sh("tc qdisc replace" + dev + "root handle 1: htb default 10 r2q 100000") &&
           sh("tc class add" + dev + "parent 1: classid 1:10 htb rate 10gbit") &&
           sh("tc class add" + dev + "parent 1: classid 1:20 htb rate " + rate + " ceil " + rate) &&
           sh("tc filter add" + dev + "parent 1: protocol ip prio 1 u32 match ip protocol 6 0xff match ip sport " +
              std::to_string(keep_port) + " 0xffff flowid 1:10") &&
           sh("tc filter add" + dev + "parent 1: protocol ip prio 2 u32 match ip protocol 6 0xff flowid 1:20");
  }
  bool starve(int node, int keep_port) { return throttle_data(node, keep_port, "8bit"); }
  bool unstarve(int node) { return unshape(node); }
  // Whether both ends of `node`'s veth report carrier (the link is up).
  bool link_up(int node);

  // Runs a shell command quietly; true when it exits 0.
  static bool sh(const std::string& command);

 private:
  NetworkLab() = default;
  bool build(int nodes);
  std::string port(int node) const { return tag_ + "-" + std::to_string(node); }

  std::string tag_;     // pcv<hex>: also the prefix of the host-side veths
  std::string bridge_;  // pcb<hex>
  std::vector<std::string> namespaces_;
};

}  // namespace paramcast::test
