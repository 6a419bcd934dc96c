"""Network namespaces on one bridge for the shaped-link benchmarks (root, iproute2).

    lab = Lab(3, subnet="10.79.0", rate="400mbit", shaped=[0, 1, 2], both_ways=True)
    subprocess.run(lab.prefix(1) + ["prog", "--host", lab.address(1)])
    lab.close()

Node i is namespace <tag>-<i> with interface pc0 at <subnet>.<i+1>, joined to
the bridge by veth <tag>v<i>. A shaped node's link is limited to `rate`
towards it (tc tbf on the bridge side) and, with `both_ways`, from it too
(tc tbf on pc0): a host with one link of that rate each way.
"""
import os
import shutil
import subprocess


def unavailable():
    """Why a lab cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2)"
    return None


class Lab:
    def __init__(self, n, subnet, rate, shaped=None, both_ways=False, prefix="pcl"):
        self.tag = f"{prefix}{os.getpid() % 100000}"
        self.subnet = subnet
        self.ns = [f"{self.tag}-{i}" for i in range(n)]
        self.sh(f"ip link add {self.tag}b type bridge && ip link set {self.tag}b up")
        for i, ns in enumerate(self.ns):
            port = f"{self.tag}v{i}"
            self.sh(f"ip netns add {ns} && ip link add {port} type veth peer name pc0 netns {ns}"
                    f" && ip link set {port} master {self.tag}b && ip link set {port} up"
                    f" && ip netns exec {ns} ip addr add {self.address(i)}/24 dev pc0"
                    f" && ip netns exec {ns} ip link set pc0 up && ip netns exec {ns} ip link set lo up")
        for i in (range(n) if shaped is None else shaped):
            self.sh(f"tc qdisc replace dev {self.tag}v{i} root tbf rate {rate} burst 256kb latency 400ms")
            if both_ways:
                self.sh(f"ip netns exec {self.ns[i]} tc qdisc replace dev pc0 root tbf rate {rate} burst 256kb"
                        f" latency 400ms")

    def address(self, i):
        return f"{self.subnet}.{i + 1}"

    def prefix(self, i):
        """The command prefix that runs a program in node i's namespace."""
        return ["ip", "netns", "exec", self.ns[i]]

    @staticmethod
    def sh(cmd):
        subprocess.run(cmd, shell=True, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def close(self):
        for i, ns in enumerate(self.ns):
            subprocess.run(f"ip link del {self.tag}v{i}; ip netns del {ns}", shell=True, stderr=subprocess.DEVNULL)
        subprocess.run(f"ip link del {self.tag}b", shell=True, stderr=subprocess.DEVNULL)
