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
      plan, rounds, forwarding between the engines);
  (c) with --publisher, (b) through ParamCast itself: paramcast-trainer
      --rank R on every trainer rank, paramcast-worker on every engine (its
      synthetic model, --model-size), the control plane included.
Each run reports each link's bytes, the time (the slowest rank's), and the
limit: the most bytes any one link must carry, divided by L.

  sudo python3 bench/reshard_bench.py --build build --rate 400mbit --hidden 640 --runs 3

With --tp K (and --replicas R): one sender to R replicas x TP=K engine ranks,
every engine rank receiving whole tensors against each receiving only its
tensor-parallel slices, then a delta version of the slices.

With --local: no namespaces and no links; (c) on this one host, on Gloo over
loopback against the shm plane (the point-to-point channels in the group's
shared memory), same model and ranks, in one run:

  python3 bench/reshard_bench.py --build build --local --model-size 256MiB --updates 6
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


def one_run(args, lab, mode, senders, engines, tp=1, delta_steps=0, detail=False):
    """`engines` replicas of `tp` engine ranks each; returns the time and each rank's (out, in) bytes,
    plus, per rank, its wanted bytes and (with delta_steps) the wire bytes of its first delta."""
    store = tempfile.mkdtemp(prefix="paramcast-reshard-bench-")
    world = senders + engines * tp
    prefix = f"bench-{os.getpid()}-{time.monotonic_ns()}"  # one rendezvous for the run's ranks
    procs = []
    for r in range(world):
        cmd = ["ip", "netns", "exec", lab.ns[r], os.path.join(args.build, "bin", "reshard_rank"),
               "--rank", str(r), "--senders", str(senders), "--replicas", str(engines), "--tp", str(tp),
               "--layout", "fsdp", "--mode", mode, "--hidden", str(args.hidden), "--host", lab.address(r),
               "--store", store, "--bootstrap", prefix, "--timeout-s", "600", "--delta-steps", str(delta_steps)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=900)[0] for p in procs]
    shutil.rmtree(store, ignore_errors=True)
    for r, (p, out) in enumerate(zip(procs, outs)):
        if p.returncode != 0 or "verified" not in out:
            raise SystemExit(f"{mode} M={senders} rank {r} failed ({p.returncode}):\n{out}")
    took = max(float(re.search(r"moved in ([\d.]+) s", o).group(1)) for o in outs)
    links = [tuple(int(x) for x in re.search(r"link out (\d+), in (\d+) bytes", o).groups()) for o in outs]
    if not detail:
        return took, links
    wanted = [int(re.search(r"wanted (\d+) bytes", o).group(1)) for o in outs]
    deltas = [tuple(int(x) for x in re.search(r"delta v2: wire out (\d+), wire in (\d+)", o).groups())
              if delta_steps else (0, 0) for o in outs]
    return took, links, wanted, deltas


def tp_bench(args, L):
    """One sender to R replicas x TP=K engine ranks: every engine rank wanting whole tensors (what a
    broadcast delivers; its loader keeps 1/K) against each wanting its tensor-parallel slices
    (column- and vocab-parallel weights cut along dim 0, row-parallel along dim 1, norms whole);
    pieces several replicas want are forwarded along them. Then one delta version (about 1 element
    in 50 changed) of the slices. Reports each engine link's bytes against its slices and the time
    against the link limit."""
    R, K = args.replicas, args.tp
    lab = netns_lab.Lab(1 + R * K, "10.79.0", args.rate, both_ways=True, prefix="pct")
    results = []
    try:
        for label, replicas, tp in (("whole", R * K, 1), ("slices", R, K)):
            times, last = [], None
            for _ in range(args.runs):
                last = one_run(args, lab, "plan", 1, replicas, tp, delta_steps=1 if label == "slices" else 0,
                               detail=True)
                times.append(last[0])
            times.sort()
            median = times[len(times) // 2]
            _, links, wanted, deltas = last
            busiest = max(max(o, i) for o, i in links)
            limit = busiest / L
            engine_in = [i for o, i in links[1:]]
            res = {"mode": label, "replicas": R, "tp": K, "median_s": median, "runs_s": times, "limit_s": limit,
                   "ratio": median / limit, "links_out_in": links, "wanted": wanted}
            print(f"{label}: {median:.2f} s (runs {', '.join(f'{t:.2f}' for t in times)}); limit {limit:.2f} s "
                  f"(busiest link {busiest / 1e6:.1f} MB); ratio {median / limit:.2f}; engine links in "
                  f"{min(engine_in) / 1e6:.2f}-{max(engine_in) / 1e6:.2f} MB, out "
                  f"{min(o for o, i in links[1:]) / 1e6:.2f}-{max(o for o, i in links[1:]) / 1e6:.2f} MB", flush=True)
            if label == "slices":
                over = max(i / w for (o, i), w in zip(links[1:], wanted[1:]))
                res["engine_in_over_slices"] = over
                res["delta_wire_in"] = [d[1] for d in deltas[1:]]
                print(f"    each engine link in / its slices: at most {over:.4f}; a delta version: "
                      f"{max(d[1] for d in deltas[1:]) / 1e6:.3f} MB into the busiest engine "
                      f"({max(d[1] / w for d, w in zip(deltas[1:], wanted[1:])):.3f} of its slices)", flush=True)
            results.append(res)
    finally:
        lab.close()
    whole, sliced = results
    print(f"slices: each engine link carries {max(i for o, i in sliced['links_out_in'][1:]) / max(i for o, i in whole['links_out_in'][1:]):.3f}"
          f" of the whole-tensor bytes (TP={K})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rate_bytes_per_s": L, "hidden": args.hidden, "results": results}, f, indent=1)


def duration_s(text):
    value, unit = text.split()
    return float(value) * {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[unit]


class OneHost:
    """--local: every rank a process of this host, on loopback (no namespace)."""
    def prefix(self, i):
        return []

    def address(self, i):
        return "127.0.0.1"


def publisher_run(args, lab, senders, engines, backend="gloo"):
    """(c) the same many-sender update through ParamCast itself: paramcast-trainer --rank on
    every trainer rank (rank 0 the publisher), paramcast-worker on every engine, the control
    plane's plan, pairing and Applied included. Returns rank 0's update times (the first, which
    connects the pairs, left out)."""
    d = tempfile.mkdtemp(prefix="paramcast-reshard-pub-")
    endpoint = f"tcp://{lab.address(0)}:47311"
    endpoint_file = os.path.join(d, "endpoint")

    def yaml(i):
        path = os.path.join(d, f"node{i}.yaml")
        with open(path, "w") as f:
            f.write(f"""control:
  endpoint: {endpoint if not local or i else "tcp://127.0.0.1:*"}
  heartbeat_interval: 200ms
  heartbeat_timeout: 5s
  join_timeout: 120s
data_plane:
  backend: {backend}
  gloo_hostname: {lab.address(i)}
  checksum: xxh64
  stall_timeout: 120s
  init_timeout: 120s
publisher:
  subscribers: {engines}
  ranks: {senders}
  update_timeout: 600s
  delta: off
trainer:
  model_size: {args.model_size}
  layers: {getattr(args, "layers", 2)}
  updates: {args.updates}
  interval: 0s
logging:
  level: warn
auth:
  mode: plain  # the benchmark's own network namespaces
""")
        return path
    binary = lambda name: os.path.join(args.build, "bin", name)  # noqa: E731
    local = isinstance(lab, OneHost)  # an ephemeral port, read back from the endpoint file
    procs = [subprocess.Popen(lab.prefix(0) + [binary("paramcast-trainer"), "--config", yaml(0)] +
                              (["--endpoint-file", endpoint_file] if local else []),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    time.sleep(0.5)
    if local:
        for _ in range(600):
            if os.path.exists(endpoint_file) and open(endpoint_file).read().strip():
                break
            time.sleep(0.05)
        endpoint = open(endpoint_file).read().strip()
    for r in range(1, senders):
        procs.append(subprocess.Popen(lab.prefix(r) + [binary("paramcast-trainer"), "--config", yaml(r), "--rank",
                                                       str(r), "--endpoint", endpoint],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for k in range(engines):
        i = senders + k
        procs.append(subprocess.Popen(lab.prefix(i) + [binary("paramcast-worker"), "--config", yaml(i), "--id",
                                                       f"worker-{k + 1}", "--endpoint", endpoint],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    shutil.rmtree(d, ignore_errors=True)
    for p, out in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"publisher path M={senders} failed ({p.returncode}):\n{out}")
    # Rank 0's line for each update (M = 1: a single sender's, "... to N subscribers in ...").
    times = [duration_s(m.group(1)) for m in re.finditer(r"to \d+ (?:members|subscribers) in ([\d.]+ \w+) \(", outs[0])]
    # The model as rank 0 states each update: "update vN: T tensors, X MiB ..." (an engine's
    # "verified" line counts what reached that engine, which a relay or a slice may make less).
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    model = [int(float(m.group(2)) * units[m.group(3)])
             for m in re.finditer(r"update v\d+: (\d+) tensors(?: in \d+ buckets)?, ([\d.]+) (B|KiB|MiB|GiB)", outs[0])][:1]
    # Rank 0's data-plane time of each update (its moves, before the last Applied).
    plane = [duration_s(m.group(1)) for m in re.finditer(r"; data plane ([\d.]+ \w+) \(", outs[0])]
    # The plan's control bytes (whole, or by reference: Plan.shapeRef), first and last update.
    plans = re.findall(r"; plan: ([^;\n]*)", outs[0])
    if plans:
        print(f"  plan messages: first update {plans[0]}; last {plans[-1]}", flush=True)
    # The trainer ranks' parts (Holdings), summed: whole on the first update, by reference after.
    parts = re.findall(r"; trainer ranks' parts: ([^;\n]*)", outs[0])
    if parts:
        print(f"  trainer ranks' part messages: first update {parts[0]}; last {parts[-1]}", flush=True)
    if times:  # the first update plans (every rank), and connects the pairs
        print(f"  first update {times[0]:.3f} s (planning and pairing included)", flush=True)
    if getattr(args, "local", False):
        return times[1:], model[0] if model else 0, plane[1:]
    return times[1:], model[0] if model else 0


def local_bench(args):
    """(c) on one host: the same many-sender update on Gloo (loopback TCP) and on the shm plane."""
    results = []
    for backend in args.backends.split(","):
        for m in (int(x) for x in args.senders.split(",")):
            times, model, plane = publisher_run(args, OneHost(), m, args.engines, backend)
            times.sort()
            plane.sort()
            median = times[len(times) // 2]
            plane_median = plane[len(plane) // 2] if plane else 0
            results.append({"backend": backend, "senders": m, "engines": args.engines, "model_bytes": model,
                            "median_s": median, "runs_s": times, "gb_per_s": model / median / 1e9,
                            "rank0_data_plane_s": plane})
            print(f"{backend}: M={m} trainer ranks to {args.engines} engines, {model / 2**20:.0f} MiB: "
                  f"{median:.3f} s (updates {', '.join(f'{t:.3f}' for t in times)}), "
                  f"{model / median / 1e9:.2f} GB/s into each engine (the engines' apply included); "
                  f"rank 0's moves {plane_median:.3f} s (the data plane alone)", flush=True)
    if len(results) == 2 and results[0]["backend"] != results[1]["backend"]:
        print(f"shm over Gloo on loopback: {results[0]['median_s'] / results[1]['median_s']:.2f}x faster")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"local": True, "results": results}, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--rate", default="400mbit")
    ap.add_argument("--hidden", type=int, default=640, help="hidden size of the 2-layer model (640: 38.5 MB)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--publisher", action="store_true",
                    help="also (c): the many-sender update through the publisher (paramcast-trainer --rank, "
                         "paramcast-worker) on the same links")
    ap.add_argument("--model-size", default="36MiB", help="(c)'s synthetic model")
    ap.add_argument("--updates", type=int, default=4, help="(c)'s updates per run (the first is left out)")
    ap.add_argument("--tp", type=int, default=0,
                    help="instead: one sender to --replicas x TP engine ranks, whole tensors vs slices")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2,
                    help="(c)'s synthetic model's layers: 9 tensors each (5556: 50,007 tensors)")
    ap.add_argument("--senders", default="2", help="--local: trainer ranks, a list (1,4,8)")
    ap.add_argument("--backends", default="gloo,shm", help="--local: data planes, a list")
    ap.add_argument("--local", action="store_true",
                    help="instead: (c) on this host, Gloo over loopback against the shm plane")
    args = ap.parse_args()
    if args.local:
        return local_bench(args)
    why = netns_lab.unavailable()
    if why:
        raise SystemExit(why)
    L = rate_bytes(args.rate)
    if args.tp:
        return tp_bench(args, L)
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
        if args.publisher:
            for m in (2, 4):
                times, model = publisher_run(args, lab, m, args.engines)
                times.sort()
                median = times[len(times) // 2]
                limit = model / L  # each engine's inbound link carries the whole model once
                results.append({"mode": "publisher", "senders": m, "engines": args.engines, "model_bytes": model,
                                "median_s": median, "runs_s": times, "limit_s": limit, "ratio": median / limit})
                print(f"(c) through the publisher M={m}: {median:.2f} s (updates {', '.join(f'{t:.2f}' for t in times)}); "
                      f"limit {limit:.2f} s ({model / 1e6:.1f} MB into each engine at {L / 1e6:.1f} MB/s); "
                      f"ratio {median / limit:.2f}", flush=True)
    finally:
        lab.close()
    base = next(r for r in results if r["mode"] == "funnel")
    for r in results:
        if r["mode"] in ("plan", "publisher"):
            print(f"M={r['senders']}: {base['median_s'] / r['median_s']:.2f}x faster than (a) as measured, "
                  f"{base['limit_s'] / r['median_s']:.2f}x faster than (a)'s own limit")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rate_bytes_per_s": L, "hidden": args.hidden, "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
