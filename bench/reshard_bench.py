#!/usr/bin/env python3
"""Many senders against the link limit (../shared LINK_LIMIT.md's model).

Every trainer rank and every engine rank runs in a network namespace of its
own, on one bridge, each behind a veth shaped to the same rate in both
directions (tc tbf on both ends): a host with one link of rate L each way.
The same LLaMA-shaped model (bf16, FSDP Shard(0) on M trainer ranks, norms
replicated) goes to 2 engines that want whole tensors, by
  (a) today's path for a sharded trainer: rank 0 gathers every tensor
      (full_tensor()), then sends each whole tensor to each engine (what a
      binomial broadcast's root sends with two engines); the two phases run
      one after the other here: the column "a limit" is the funnel's own
      limit with them fully overlapped, the best it could do;
  (b) every trainer rank sending its shard point to point (common/reshard/:
      plan, rounds, forwarding between the engines).
Each run reports each link's bytes, the time (the slowest rank's), and the
limit: the most bytes any one link must carry, divided by L.

  sudo python3 bench/reshard_bench.py --build build --rate 400mbit --hidden 640 --runs 3
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns_lab  # noqa: E402


def rate_bytes(rate):
    m = re.fullmatch(r"(\d+)(k|m|g)?bit", rate)
    if not m:
        raise SystemExit(f"--rate {rate}: expected e.g. 400mbit")
    return int(m.group(1)) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8


def one_run(args, lab, mode, senders, engines):
    store = tempfile.mkdtemp(prefix="paramcast-reshard-bench-")
    world = senders + engines
    prefix = f"bench-{os.getpid()}-{time.monotonic_ns()}"  # one rendezvous for the run's ranks
    procs = []
    for r in range(world):
        cmd = ["ip", "netns", "exec", lab.ns[r], os.path.join(args.build, "bin", "reshard_rank"),
               "--rank", str(r), "--senders", str(senders), "--replicas", str(engines), "--tp", "1",
               "--layout", "fsdp", "--mode", mode, "--hidden", str(args.hidden), "--host", lab.address(r),
               "--store", store, "--bootstrap", prefix, "--timeout-s", "600"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=900)[0] for p in procs]
    shutil.rmtree(store, ignore_errors=True)
    for r, (p, out) in enumerate(zip(procs, outs)):
        if p.returncode != 0 or "verified" not in out:
            raise SystemExit(f"{mode} M={senders} rank {r} failed ({p.returncode}):\n{out}")
    took = max(float(re.search(r"moved in ([\d.]+) s", o).group(1)) for o in outs)
    links = [tuple(int(x) for x in re.search(r"link out (\d+), in (\d+) bytes", o).groups()) for o in outs]
    return took, links


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--rate", default="400mbit")
    ap.add_argument("--hidden", type=int, default=640, help="hidden size of the 2-layer model (640: 38.5 MB)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    why = netns_lab.unavailable()
    if why:
        raise SystemExit(why)
    L = rate_bytes(args.rate)
    cases = [("funnel", 4), ("plan", 2), ("plan", 4)]
    lab = netns_lab.Lab(max(m for _, m in cases) + args.engines, "10.79.0", args.rate, both_ways=True, prefix="pcr")
    results = []
    try:
        for mode, m in cases:
            times, links = [], None
            for _ in range(args.runs):
                t, links = one_run(args, lab, mode, m, args.engines)
                times.append(t)
            times.sort()
            median = times[len(times) // 2]
            busiest = max(max(o, i) for o, i in links)
            model = links[m][1]  # an engine's inbound link: the whole model
            if mode == "funnel":  # fully overlapped gather and publish: rank 0's busier direction
                limit = max(links[0]) / L
            else:
                limit = busiest / L
            results.append({"mode": mode, "senders": m, "engines": args.engines, "model_bytes": model,
                            "median_s": median, "runs_s": times, "limit_s": limit, "ratio": median / limit,
                            "links_out_in": links})
            print(f"{'(a) gather+publish' if mode == 'funnel' else '(b) many senders'} M={m}: "
                  f"{median:.2f} s (runs {', '.join(f'{t:.2f}' for t in times)}); limit {limit:.2f} s "
                  f"(busiest link {busiest / 1e6:.1f} MB at {L / 1e6:.1f} MB/s); ratio {median / limit:.2f}",
                  flush=True)
            for r, (o, i) in enumerate(links):
                who = f"trainer-{r}" if r < m else f"engine-{r - m}"
                print(f"    {who}: out {o / 1e6:.1f} MB, in {i / 1e6:.1f} MB")
    finally:
        lab.close()
    base = next(r for r in results if r["mode"] == "funnel")
    for r in results:
        if r["mode"] == "plan":
            print(f"M={r['senders']}: {base['median_s'] / r['median_s']:.2f}x faster than (a) as measured, "
                  f"{base['limit_s'] / r['median_s']:.2f}x faster than (a)'s own limit")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rate_bytes_per_s": L, "hidden": args.hidden, "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
