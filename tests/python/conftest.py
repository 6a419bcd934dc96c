import os
import sys

# The tests' helpers (cluster) and the examples' model (tinylm) import as
# top-level modules, also in engine processes (their process server is given sys.path).
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "python")
sys.path[:0] = [HERE, EXAMPLES]


def pytest_terminal_summary(terminalreporter):
    """Each skip as "<test>: Skipped" and its reason, the two lines tests/run.sh collects."""
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        terminalreporter.write_line(f"{report.nodeid}: Skipped")
        terminalreporter.write_line(reason.removeprefix("Skipped: "))
