#!/usr/bin/env python3
"""torch.distributed's per-parameter broadcast, the baseline ParamCast's Gloo
plane is compared with.

What an RLHF job does without ParamCast: every parameter broadcast on its own
from rank 0 with torch.distributed over Gloo. Same shape as paramcast-bench's
T=291 case: the LLaMA-shaped layout of common/synthetic_model.cc (32 layers,
291 tensors) at --size bytes, fp16 (the same bytes as bf16, which Gloo's
broadcast of older PyTorch does not take), one allocation per tensor,
--world ranks on this machine, loopback TCP. Each repeat is timed on rank 0
from the first broadcast until a barrier after every rank has all of them;
the first repeat warms up.

    python3 bench/torch_broadcast_bench.py [--size 512MiB] [--world 8] [--repeats 3] [--json out.json]

Runs with Debian's python3-torch (1.13) or a current PyTorch.
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time


def parse_size(text):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text)


def llm_layout(target_bytes, layers=32, esize=2):
    """The shapes of paramcast::synthetic_llm_layout, in the same order."""

    def bytes_for(h):
        inter = h * 43 // 16
        vocab = min(32000, 32 * h)
        per_layer = 4 * h * h + 3 * h * inter + 2 * h
        return (layers * per_layer + 2 * vocab * h + h) * esize

    h = 8
    while bytes_for(h + 8) <= target_bytes:
        h += 8
    inter, vocab = h * 43 // 16, min(32000, 32 * h)
    shapes = [(vocab, h)]
    for _ in range(layers):
        shapes += [(h, h)] * 4 + [(inter, h), (inter, h), (h, inter), (h,), (h,)]
    return shapes + [(h,), (vocab, h)]


def rank_main(rank, world, port, size, repeats, out):
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shapes = llm_layout(size)
    params = [torch.full(s, float(rank), dtype=torch.float16) for s in shapes]
    total = sum(p.numel() * p.element_size() for p in params)
    rates = []
    for rep in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for p in params:
            dist.broadcast(p, src=0)
        dist.barrier()
        secs = time.perf_counter() - t0
        if rep > 0:
            rates.append(total / secs / 1e9)
    ok = all(bool((p == 0).all()) for p in params)
    if rank == 0:
        out.put({"tensors": len(params), "bytes": total, "gbps": rates})
    else:
        out.put({"rank": rank, "verified": ok})
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="512MiB")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.world, port, parse_size(args.size), args.repeats, out))
             for r in range(args.world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    root = next(r for r in results if "gbps" in r)
    bad = [r["rank"] for r in results if r.get("verified") is False]
    if bad:
        print(f"ranks {bad} did not receive rank 0's bytes", file=sys.stderr)
        return 1
    g = root["gbps"]
    print(f"torch.distributed {torch.__version__} gloo, per-parameter broadcast: {root['tensors']} tensors, "
          f"{root['bytes'] / (1 << 20):.2f} MiB fp16, world {args.world}: "
          f"{statistics.median(g):.3f} GB/s (min {min(g):.3f}, max {max(g):.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "world": args.world, **root,
                       "median_gbps": statistics.median(g)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
