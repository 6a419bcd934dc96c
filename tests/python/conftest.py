import os
import sys

# The tests' helpers (cluster) and the examples' model (tinylm) import as
# top-level modules, also in spawned engine processes (spawn passes sys.path).
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "python")
sys.path[:0] = [HERE, EXAMPLES]
