"""Runs the Python example: one PyTorch trainer and N engines on this machine.

    python3 examples/python/launch.py [--engines 3] [--steps 5] [--dtype bfloat16]

Engine 1 fuses q/k/v on load (load_weights); the others register their
parameters in place. At the end every engine's logits must equal the
trainer's, bit for bit. Uses the paramcast package installed for this Python
(pip install .), or else the one built in build/python (example_env.py).
"""

import argparse
import os
import subprocess
import threading
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [HERE, env.get("PYTHONPATH", "")] if p)
    common = ["--dtype", args.dtype]
    trainer = subprocess.Popen([sys.executable, os.path.join(HERE, "trainer.py"), "--engines", str(args.engines),
                                "--steps", str(args.steps)] + common, env=env, stdout=subprocess.PIPE, text=True)
    first = trainer.stdout.readline().split()
    if len(first) != 2 or first[0] != "endpoint":
        trainer.wait()
        sys.exit(f"launch: the trainer did not start (exit code {trainer.returncode}); its error is above")
    engines = []
    for i in range(1, args.engines + 1):
        cmd = [sys.executable, os.path.join(HERE, "engine.py"), "--endpoint", first[1], "--id", f"engine-{i}",
               "--updates", str(args.steps)] + common + (["--fused"] if i == 1 else [])
        engines.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))

    digests = {}

    def relay(name, proc):
        out = []
        for line in proc.stdout:
            if line.startswith("logits "):
                digests[name] = line.split()[1]
            else:
                print(line, end="", flush=True)
            out.append(line)
        return proc.wait()

    threads = [threading.Thread(target=relay, args=(f"engine-{i + 1}", p)) for i, p in enumerate(engines)]
    for t in threads:
        t.start()
    code = relay("trainer", trainer)
    for t in threads:
        t.join()
    codes = [code] + [p.returncode for p in engines]
    if any(codes):
        sys.exit(f"launch: exit codes trainer {codes[0]}, engines {codes[1:]}")
    if len(set(digests.values())) != 1 or len(digests) != args.engines + 1:
        sys.exit(f"launch: logits differ: {digests}")
    print(f"launch: {args.engines} engines hold the trainer's weights after {args.steps} steps "
          f"(logits identical, sha256 {digests['trainer']})")


if __name__ == "__main__":
    main()
