"""A trainer process for test_faults: interrupted (SIGINT) inside weight_update.

Prints "endpoint E", then "updating" just before the first weight_update,
"interrupted T" (time.monotonic()) when Ctrl-C reaches it, and after a
second update "second V ok|error" and "first ok|error" (the interrupted
update's outcome).
"""

import sys
import time

import torch

import paramcast
import tinylm as tinymodel
from cluster import config_dict


def say(*words):
    print(*words, flush=True)


def main():
    torch.set_num_threads(1)
    model = tinymodel.TinyLM(0)
    with paramcast.Publisher(config_dict(subscribers=1)) as pub:
        say("endpoint", pub.endpoint)
        pub.start()
        say("updating")
        try:
            pub.weight_update(model.named_parameters())
            say("not interrupted")
            return 1
        except KeyboardInterrupt:
            say("interrupted", time.monotonic())
        # The interrupted update still reads the model's tensors in the
        # background: the next update is built from new tensors.
        bumped = {name: p.detach() + 1 for name, p in model.named_parameters()}
        try:
            result = pub.weight_update(bumped)
            say("second", result.version, "ok")
        except paramcast.UpdateError as e:
            say("second", e.result.version, "error", str(e).replace("\n", " | "))
        first = pub.interrupted_result
        say("first", "ok" if first is not None and first.ok else f"error {first}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
