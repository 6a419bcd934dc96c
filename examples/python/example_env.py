"""What the examples need, checked before they import it: PyTorch, and the paramcast package, as installed
for this Python (``pip install .``) or else as built in this checkout's build/python
(``bash deploy/build.sh``). Each missing piece is named, with how to get it."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILT = os.path.join(ROOT, "build", "python")


def require():
    prog = os.path.basename(sys.argv[0]) or "example"
    if importlib.util.find_spec("torch") is None:
        sys.exit(f"{prog}: this example needs PyTorch, which {sys.executable} does not have "
                 "(pip install torch, or run it with a Python that has it)")
    if importlib.util.find_spec("paramcast") is None:
        if os.path.isfile(os.path.join(BUILT, "paramcast", "__init__.py")):
            sys.path.append(BUILT)
        else:
            sys.exit(f"{prog}: the paramcast package is neither installed for {sys.executable} "
                     f"(pip install {ROOT}) nor built in {BUILT} (bash deploy/build.sh)")


require()
