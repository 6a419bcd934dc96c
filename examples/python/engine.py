"""An inference engine that generates with the weights the trainer publishes.

    python3 examples/python/engine.py --endpoint tcp://127.0.0.1:PORT --id engine-1 [--fused]

Without --fused the engine's parameters are registered and written in place;
with --fused its model keeps q/k/v in one qkv_proj per layer and takes the
trainer's weights through its vLLM-style load_weights. Generation pauses
while an update is applied (on_update_begin / on_update_end).
"""

import argparse
import threading

import example_env  # noqa: F401 - names a missing PyTorch or paramcast first
import torch

import paramcast
import tinylm
from trainer import config


def generate(model, steps=6):
    ids = tinylm.PROMPT[:, :4]
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    return ids[0, 4:].tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", required=True, help="the trainer's control endpoint")
    ap.add_argument("--id", required=True, help="this engine's worker id")
    ap.add_argument("--fused", action="store_true", help="fuse q/k/v on load (load_weights)")
    ap.add_argument("--updates", type=int, default=5, help="updates to wait for before exiting (default 5)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()

    torch.set_num_threads(1)
    model_type = tinylm.FusedTinyLM if args.fused else tinylm.TinyLM
    model = model_type(seed=sum(args.id.encode()), dtype=getattr(torch, args.dtype))
    serving = threading.Lock()  # held while generating; an update waits for it

    with paramcast.Subscriber(config(1, args.endpoint), args.id) as sub:
        if args.fused:
            sub.on_weights(model.load_weights)
        else:
            sub.register(model.named_parameters())
        sub.on_update_begin(lambda version: serving.acquire())
        sub.on_update_end(lambda version, error: serving.release())
        sub.start()
        for version in range(1, args.updates + 1):
            sub.wait_for_version(version, timeout=300)
            with serving:
                print(f"{args.id}: v{sub.version} generates {generate(model)}", flush=True)
        digest = tinylm.digest(tinylm.logits(model).float())
        print("logits", digest, flush=True)


if __name__ == "__main__":
    main()
