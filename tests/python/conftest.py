import os
import sys

# The tests' helpers (tinymodel, cluster) import as top-level modules, also in spawned engines.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
