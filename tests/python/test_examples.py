"""The Python example (examples/python/launch.py) runs as a user runs it, also
where PyTorch came from PyPI without numpy: every engine ends with the
trainer's logits, bit for bit."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torch_without_numpy_imports():
    major, minor = (int(x) for x in __import__("torch").__version__.split(".")[:2])
    return (major, minor) >= (2, 0)  # 1.13 needs numpy at import


@pytest.mark.skipif(not _torch_without_numpy_imports(), reason="this PyTorch needs numpy to import")
def test_example_runs_without_numpy(tmp_path):
    blocked = tmp_path / "numpy"
    blocked.mkdir()
    (blocked / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'numpy\' (hidden by this test)", name="numpy")\n')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "python", "launch.py"), "--engines", "2",
                          "--steps", "2"], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "logits identical" in out.stdout, out.stdout + out.stderr
