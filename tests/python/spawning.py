"""How the Python tests start their child processes (engines, trainer ranks, vLLM workers).

"spawn" starts a fresh interpreter that imports PyTorch (and transformers) again: 3 to 15 s a
process on a loaded 2-core machine, which was most of the Python suite's time. "forkserver"
forks each child from one server process that imported them once. A child is still a process
of its own that shares no thread and no state with the test, and its target and arguments
still travel by pickle, as with spawn; it sees the environment and the sys.path the server
started with (a variable the test sets later must be set in the child, or the child started
with spawn). Where a pytest process's sys.path changed after its server started (a file that
puts vLLM's own sources on it, run in one process after a file that does not), a child must
import what the test now imports: context() then gives spawn.
"""

import multiprocessing
import sys

# The module the children of the tests that build a transformers Llama import (and the server once).
LLAMA = "transformers.models.llama.modeling_llama"
_server_path = None  # sys.path when the first context() was asked for


def context(*preload):
    """A multiprocessing context whose children start with torch (and `preload`) imported. The
    first call in a process fixes what the server imports."""
    global _server_path
    if _server_path is None:
        _server_path = list(sys.path)
    elif _server_path != sys.path:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", *preload])
    return ctx
