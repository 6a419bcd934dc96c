#!/usr/bin/env python3
"""FP8 on the wire against BF16 as it is, same model, same links, same run.

A trainer process holds a LLaMA-shaped model (transformers, random weights
from a config) in bf16 and publishes it --updates times twice: with no
transforms (engines register bf16), and with publisher.transforms sending
every projection weight as FP8 with 128x128 block scales (engines register
float8_e4m3fn weights and float32 `_scale_inv` tensors; embeddings, norms
and lm_head as they are). Delta off, so every update is dense. On two links:

  loopback   every process on this host;
  shaped     the engines in a network namespace behind a veth whose traffic
             towards them is shaped to --rate by tc tbf (needs root and
             iproute2; skipped, saying why, otherwise).

Reports per link the bytes per update, the median update time of each mode
and their ratios. The CPU rate of the quantizer alone is
build/bin/paramcast-transform-bench.

    python3 bench/fp8_bench.py [--layers 8] [--updates 4] [--engines 2] [--json out.json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import delta_bench  # noqa: E402  (the model and the config)
import netns_lab  # noqa: E402

FP8_RULES = [{"match": "*proj.weight", "fp8": "block"}]


def engine_specs(layers, mode):
    out = []
    for name, _, shape in delta_bench.manifest(layers):
        if mode == "fp8" and name.endswith("proj.weight"):
            out.append((name, "float8_e4m3fn", shape))
            out.append((name + "_scale_inv", "float32", [-(-shape[0] // 128), -(-shape[1] // 128)]))
        else:
            out.append((name, "bfloat16", shape))
    return out


def config(mode, engines, endpoint, host):
    cfg = delta_bench.config("off", engines, endpoint, host)
    if mode == "fp8":
        cfg["publisher"]["transforms"] = FP8_RULES
    return cfg


def run_trainer(args):
    import paramcast
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(delta_bench.llama_config(args.layers))
    weights = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    pub = paramcast.Publisher(config(args.mode, args.engines, args.endpoint, args.host))
    print(json.dumps({"endpoint": pub.endpoint}), flush=True)
    pub.start()
    for _ in range(args.updates):
        r = pub.weight_update(weights.items())
        print(json.dumps({"version": r.version, "bytes": r.bytes, "wire_bytes": r.wire_bytes, "seconds": r.seconds,
                          "data_seconds": r.data_seconds, "transformed": r.transformed}), flush=True)
    pub.close()


def run_engine(args):
    import paramcast
    import torch

    sub = paramcast.Subscriber(config(args.mode, args.engines, args.endpoint, args.host), args.worker)
    sub.register([(n, torch.zeros(s, dtype=getattr(torch, d))) for n, d, s in engine_specs(args.layers, args.mode)])
    with sub:
        sub.start()
        sub.wait_for_version(args.updates, timeout=1800)


def one_run(args, mode, lab):
    me = [sys.executable, os.path.abspath(__file__)]
    common = ["--layers", str(args.layers), "--updates", str(args.updates), "--engines", str(args.engines),
              "--mode", mode]
    host_t, host_e = ("10.78.0.1", "10.78.0.2") if lab else ("127.0.0.1", "127.0.0.1")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    trainer = subprocess.Popen((lab.prefix(0) if lab else []) + me + ["--role", "trainer", "--endpoint",
                                                                    f"tcp://{host_t}:*", "--host", host_t] + common,
                               stdout=subprocess.PIPE, text=True, env=env)
    endpoint = json.loads(trainer.stdout.readline())["endpoint"]
    engines = [subprocess.Popen((lab.prefix(1) if lab else []) + me + ["--role", "engine", "--worker", f"engine-{i + 1}",
                                                                      "--endpoint", endpoint, "--host", host_e] + common,
                                env=env) for i in range(args.engines)]
    rows = [json.loads(line) for line in trainer.stdout]
    trainer.wait()
    for e in engines:
        e.wait(120)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="driver", choices=["driver", "trainer", "engine"])
    ap.add_argument("--mode", default="bf16")
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--links", default="loopback,shaped")
    ap.add_argument("--endpoint", default="")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--worker", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.role == "trainer":
        return run_trainer(args)
    if args.role == "engine":
        return run_engine(args)

    report = {"date": time.strftime("%Y-%m-%d"), "host": os.uname().nodename, "cpus": os.cpu_count(),
              "layers": args.layers, "engines": args.engines, "rules": FP8_RULES, "links": {}}
    for link in args.links.split(","):
        lab = None
        if link == "shaped":
            why = netns_lab.unavailable()
            if why:
                print(f"{link} ({args.rate}): skipped: {why}")
                continue
            lab = netns_lab.Lab(2, "10.78.0", args.rate, shaped=[1], prefix="pcf")
        try:
            runs = {mode: one_run(args, mode, lab) for mode in ("bf16", "fp8")}
        finally:
            if lab:
                lab.close()
        name = f"{link} ({args.rate})" if lab else link
        t = {m: statistics.median(r["seconds"] for r in runs[m]) for m in runs}
        b = {m: runs[m][0]["bytes"] for m in runs}
        print(f"== {name}: {args.engines} engines, {args.updates} dense updates per mode")
        print(f"   bf16 as is: {b['bf16'] / 2**20:.1f} MiB, median {t['bf16']:.3f} s; fp8 block: "
              f"{b['fp8'] / 2**20:.1f} MiB ({runs['fp8'][0]['transformed']} tensors quantized), median "
              f"{t['fp8']:.3f} s; bytes fp8/bf16 {b['fp8'] / b['bf16']:.3f}, time bf16/fp8 {t['bf16'] / t['fp8']:.2f}x")
        report["links"][name] = {"runs": runs, "median_s": t, "bytes": b, "bytes_ratio": b["fp8"] / b["bf16"],
                                 "speedup": t["bf16"] / t["fp8"]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
