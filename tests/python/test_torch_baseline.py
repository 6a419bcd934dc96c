"""bench/torch_broadcast_bench.py, the torch.distributed baseline of
docs/PERFORMANCE.md: it broadcasts the same LLaMA-shaped layout as
paramcast-bench's T=291 case, and every rank ends with rank 0's bytes."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "torch_broadcast_bench.py")
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch_broadcast_bench as tbb  # noqa: E402


def test_layout_is_the_synthetic_llm_layout():
    shapes = tbb.llm_layout(512 << 20)
    assert len(shapes) == 291  # embed, 32 layers of 9, norm, lm_head
    total = sum(2 * (s[0] * (s[1] if len(s) > 1 else 1)) for s in shapes)
    assert 500 << 20 < total <= 512 << 20
    h = shapes[1][0]
    assert shapes[1] == (h, h) and shapes[5] == (h * 43 // 16, h) and shapes[8] == (h,)
    assert tbb.parse_size("8MiB") == 8 << 20 and tbb.parse_size("1GiB") == 1 << 30


def test_every_rank_gets_rank_zeros_bytes(tmp_path):
    out = tmp_path / "torch.json"
    r = subprocess.run([sys.executable, SCRIPT, "--size", "4MiB", "--world", "2", "--repeats", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "291 tensors" in r.stdout, r.stdout
    res = json.loads(out.read_text())
    assert res["tensors"] == 291 and res["world"] == 2
    assert len(res["gbps"]) == 1 and res["gbps"][0] > 0
