#!/usr/bin/env python3
"""Delta updates against dense ones, same run, same training trajectory.

A trainer process trains a LLaMA-shaped model (transformers, random weights
from a config; fp32 master weights, AdamW at --lr, a real forward/backward
on random tokens) and publishes it in bf16 after every step; engine
processes register bf16 buffers and apply the updates in place. The run is
made twice, with publisher.delta off and auto, on two links:

  loopback   every process on this host;
  1gbit      the engines in a network namespace behind a veth whose traffic
             towards them is shaped to --rate by tc tbf (needs root and
             iproute2; skipped, saying why, otherwise).

Per update it reports the changed fraction of bf16 elements, wire bytes
over dense bytes, and the update's time; then, per link, the median time of
the updates after the first (dense in both) and the ratio off/auto.

    python3 bench/delta_bench.py [--steps 6] [--layers 8] [--engines 2] [--json out.json]
Needs the paramcast package (build/python, or installed) and transformers.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns_lab  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "build", "python"))


def llama_config(layers):
    import transformers

    return transformers.LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816,
                                    num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                                    max_position_embeddings=256, tie_word_embeddings=False)


def manifest(layers):
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(layers))
    return [(n, "BF16", list(p.shape)) for n, p in model.named_parameters()]


def config(mode, engines, endpoint, host):
    return {
        "control": {"endpoint": endpoint, "heartbeat_interval": "200ms", "heartbeat_timeout": "3s",
                    "join_timeout": "120s"},
        "data_plane": {"backend": "gloo", "gloo_hostname": host, "bucket_size": "64MiB", "direct_min_size": "1MiB",
                       "stall_timeout": "60s", "init_timeout": "60s"},
        "publisher": {"subscribers": engines, "update_timeout": "600s", "delta": mode},
        "auth": {"mode": "plain"},  # loopback, or the bench's own namespaces
        "logging": {"level": "warn"},
    }


def run_trainer(args):
    import paramcast
    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = transformers.LlamaForCausalLM(llama_config(args.layers))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    pub = paramcast.Publisher(config(args.mode, args.engines, args.endpoint, args.host))
    print(json.dumps({"endpoint": pub.endpoint}), flush=True)
    pub.start()
    previous = None
    for step in range(args.steps):
        if step:
            ids = torch.randint(0, 8192, (2, 64), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        weights = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
        changed = total = 0
        if previous is not None:
            for n, w in weights.items():
                changed += (w.view(torch.int16) != previous[n].view(torch.int16)).sum().item()
                total += w.numel()
        r = pub.weight_update(weights.items())
        print(json.dumps({"version": r.version, "bytes": r.bytes, "wire_bytes": r.wire_bytes, "seconds": r.seconds,
                          "delta": r.delta, "dense_because": r.dense_because,
                          "changed": changed / total if total else 1.0}), flush=True)
        previous = weights
    pub.close()


def run_engine(args):
    import paramcast
    import torch

    cfg = config("auto", args.engines, args.endpoint, args.host)
    sub = paramcast.Subscriber(cfg, args.worker)
    sub.register([(n, torch.zeros(s, dtype=torch.bfloat16)) for n, _, s in manifest(args.layers)])
    with sub:
        sub.start()
        sub.wait_for_version(args.steps, timeout=1800)


def one_run(args, mode, lab):
    me = [sys.executable, os.path.abspath(__file__)]
    common = ["--layers", str(args.layers), "--steps", str(args.steps), "--engines", str(args.engines),
              "--lr", str(args.lr)]
    host_t, host_e = ("10.78.0.1", "10.78.0.2") if lab else ("127.0.0.1", "127.0.0.1")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    trainer = subprocess.Popen((lab.prefix(0) if lab else []) + me + ["--role", "trainer", "--mode", mode,
                                                                    "--endpoint", f"tcp://{host_t}:*",
                                                                    "--host", host_t] + common,
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
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--steps", type=int, default=6, help="updates per run (the first is dense in every mode)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-6)
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
              "lr": args.lr, "layers": args.layers, "engines": args.engines, "links": {}}
    for link in args.links.split(","):
        lab = None
        if link == "shaped":
            why = netns_lab.unavailable()
            if why:
                print(f"{link} ({args.rate}): skipped: {why}")
                continue
            # The trainer's namespace (10.78.0.1) and the engines' (10.78.0.2), the
            # traffic towards the engines shaped to the rate.
            lab = netns_lab.Lab(2, "10.78.0", args.rate, shaped=[1], prefix="pcd")
        try:
            runs = {mode: one_run(args, mode, lab) for mode in ("off", "auto")}
        finally:
            if lab:
                lab.close()
        name = f"{link} ({args.rate})" if lab else link
        print(f"== {name}: {args.engines} engines, lr {args.lr}")
        print(f"{'version':>7} {'changed':>8} {'wire/dense':>10} {'off s':>8} {'auto s':>8}")
        for off, auto in zip(runs["off"], runs["auto"]):
            print(f"{off['version']:>7} {auto['changed']:>8.4f} {auto['wire_bytes'] / auto['bytes']:>10.4f} "
                  f"{off['seconds']:>8.3f} {auto['seconds']:>8.3f}")
        later = slice(1, None)
        t_off = statistics.median(r["seconds"] for r in runs["off"][later])
        t_auto = statistics.median(r["seconds"] for r in runs["auto"][later])
        ratio = statistics.median(r["wire_bytes"] / r["bytes"] for r in runs["auto"][later])
        print(f"median after the first: off {t_off:.3f} s, auto {t_auto:.3f} s: delta {t_off / t_auto:.2f}x faster; "
              f"wire/dense {ratio:.4f}; {runs['auto'][0]['bytes'] / 2**20:.0f} MiB per update")
        report["links"][name] = {"runs": runs, "median_off_s": t_off, "median_auto_s": t_auto,
                                 "speedup": t_off / t_auto, "wire_over_dense": ratio}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
