"""How the Python tests start their child processes (engines, trainer ranks, vLLM workers).

"spawn" starts a fresh interpreter that imports PyTorch (and transformers) again: 3 to 15 s a
process on a loaded 2-core machine, which was most of the Python suite's time. "forkserver"
forks each child from one server process that imported them once. A child is still a process
of its own that shares no thread and no state with the test, and its target and arguments
still travel by pickle, as with spawn; it sees the environment the server started with (a
variable the test sets later must be set in the child, or the child started with spawn).
"""

import multiprocessing


def context(*preload):
    """A multiprocessing context whose children start with torch (and `preload`) imported. The
    first call in a process fixes what the server imports."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", *preload])
    return ctx
