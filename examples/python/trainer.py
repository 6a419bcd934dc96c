"""A PyTorch training loop that publishes its weights after every optimizer step.

    python3 examples/python/trainer.py --engines 2 --steps 5

Prints "endpoint tcp://..." first (engines connect there), then one line per
step, and finally "logits <sha256>" of its logits on a fixed prompt.
"""

import argparse

import example_env  # noqa: F401 - names a missing PyTorch or paramcast first
import torch

import paramcast
import tinylm


def config(engines, endpoint="tcp://127.0.0.1:*"):
    """The deployment as a dict with deploy/*.yaml's keys (a YAML path works too)."""
    return {
        "control": {"endpoint": endpoint, "heartbeat_interval": "250ms", "heartbeat_timeout": "3s",
                    "join_timeout": "120s"},
        "data_plane": {"backend": "gloo", "checksum": "xxh64", "stall_timeout": "30s"},
        "publisher": {"subscribers": engines},
        "logging": {"level": "warn"},
    }


def logits_digest(model):
    return tinylm.digest(tinylm.logits(model).float())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=2, help="engines to wait for (default 2)")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps, one update after each (default 5)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()

    torch.set_num_threads(1)
    model = tinylm.TinyLM(seed=0, dtype=getattr(torch, args.dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with paramcast.Publisher(config(args.engines)) as pub:
        print("endpoint", pub.endpoint, flush=True)
        pub.start()
        for step in range(1, args.steps + 1):
            loss = tinylm.train_step(model, optimizer, seed=step)
            result = pub.weight_update(model.named_parameters())  # returns when every engine applied it
            print(f"trainer: step {step} loss {loss:.4f} -> v{result.version}: {result.bytes} bytes to "
                  f"{len(result.subscribers)} engines in {result.seconds * 1e3:.1f} ms", flush=True)
        print("logits", logits_digest(model), flush=True)


if __name__ == "__main__":
    main()
