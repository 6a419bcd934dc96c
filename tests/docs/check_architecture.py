#!/usr/bin/env python3
"""Keeps docs/ARCHITECTURE.md's room table ("Where things are") in step with the folders.

Fails (exit 1, naming each problem) when
  - a room folder has no row: each folder under common/, and the top-level trainer_side/,
    inference_side/, deploy/, python/, bench/, tests/, schemas/, examples/, cmake/;
  - a row's folder column names a path that does not exist.

The folder column is the table's second; every `backticked` path in it counts.

    check_architecture.py [REPO_ROOT]      (default: this file's ../..)
"""

import pathlib
import re
import sys

TOP_LEVEL_ROOMS = ("trainer_side", "inference_side", "deploy", "python", "bench", "tests", "schemas", "examples",
                   "cmake")
SECTION = "## Where things are"


def room_folders(root):
    """The folders that must each have a row, as 'common/control' etc."""
    rooms = {"common/" + p.name for p in (root / "common").iterdir()
             if p.is_dir() and not p.name.startswith((".", "__"))}
    rooms.update(TOP_LEVEL_ROOMS)
    return rooms


def table_folders(text):
    """[(line number, [paths named in the folder column])] of the room table's rows."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == SECTION)
    except StopIteration:
        raise SystemExit(f"docs/ARCHITECTURE.md: no '{SECTION}' section")
    rows = []
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if line.startswith("## "):
            break
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] == "room" or set(cells[0]) <= set("- :"):
            continue  # the header and its rule
        rows.append((i + 1, re.findall(r"`([^`]+)`", cells[1])))
    return rows


def check(root):
    root = pathlib.Path(root).resolve()
    doc = root / "docs" / "ARCHITECTURE.md"
    rows = table_folders(doc.read_text())
    problems = []
    named = set()
    for line_no, paths in rows:
        if not paths:
            problems.append(f"docs/ARCHITECTURE.md:{line_no}: a row without a `folder`")
        for path in paths:
            if not (root / path).exists():
                problems.append(f"docs/ARCHITECTURE.md:{line_no}: `{path}` does not exist")
            named.add(path.rstrip("/"))
    for room in sorted(room_folders(root)):
        if room not in named:
            problems.append(f"docs/ARCHITECTURE.md: the room folder {room}/ has no row in '{SECTION}'")
    return problems


def main(argv):
    root = argv[1] if len(argv) > 1 else pathlib.Path(__file__).resolve().parents[2]
    problems = check(root)
    for p in problems:
        print(p)
    if problems:
        return 1
    print("docs/ARCHITECTURE.md: every room folder has a row, every row's folder exists")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
