#!/usr/bin/env python3
"""Fetches vLLM's own weight-transfer sources from the pinned PyPI wheel, for test_vllm_real.py.

    fetch_vllm.py [CACHE_DIR]     (default: $PARAMCAST_VLLM_CACHE, else ~/.cache/paramcast)

Downloads ``vllm==VERSION`` (``pip download --no-deps``, the manylinux wheel, checked against its
sha256) and unpacks only ``MEMBERS`` into ``CACHE_DIR/vllm-VERSION/src``; the wheel is then deleted.
A later run finds ``src/COMPLETE`` and downloads nothing. Prints the source directory on success;
exits 77 with the reason on its last line when the wheel cannot be had (no network, PyPI down).
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

VERSION = "0.33.0"
WHEEL = f"vllm-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
SHA256 = "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
# What the test imports (the first five) or reads as source and runs method by method (the rest).
MEMBERS = [
    "vllm/_version.py",
    "vllm/distributed/weight_transfer/__init__.py",
    "vllm/distributed/weight_transfer/base.py",
    "vllm/distributed/weight_transfer/factory.py",
    "vllm/distributed/weight_transfer/clients.py",
    "vllm/config/weight_transfer.py",
    "vllm/model_executor/model_loader/mtp_validation.py",
    "vllm/v1/worker/gpu_worker.py",
    "vllm/entrypoints/rl/offline.py",
]
SKIP = 77


def cache_root(argv):
    if len(argv) > 1:
        return argv[1]
    return os.environ.get("PARAMCAST_VLLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "paramcast")


def fetch(root):
    """The unpacked source directory; raises RuntimeError saying why it could not be had."""
    src = os.path.join(root, f"vllm-{VERSION}", "src")
    if os.path.exists(os.path.join(src, "COMPLETE")):
        return src
    os.makedirs(os.path.dirname(src), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(src)) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--implementation", "cp",
               "--dest", tmp, f"vllm=={VERSION}"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"pip download vllm=={VERSION} took over 900 s") from None
        wheel = os.path.join(tmp, WHEEL)
        if out.returncode != 0 or not os.path.exists(wheel):
            last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"pip download vllm=={VERSION} failed (is PyPI reachable?): {last}")
        digest = hashlib.sha256()
        with open(wheel, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != SHA256:
            raise RuntimeError(f"{WHEEL}: sha256 {digest.hexdigest()}, expected {SHA256}")
        unpacked = os.path.join(tmp, "src")
        with zipfile.ZipFile(wheel) as z:
            for member in MEMBERS:
                z.extract(member, unpacked)
        with open(os.path.join(unpacked, "COMPLETE"), "w") as f:
            f.write(f"{WHEEL} sha256 {SHA256}\n")
        os.remove(wheel)
        shutil.rmtree(src, ignore_errors=True)
        os.replace(unpacked, src)
    return src


def main(argv):
    try:
        print(fetch(cache_root(argv)))
    except RuntimeError as e:
        print(f"tests/python/fetch_vllm.py: Skipped\n{e}")
        return SKIP
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
