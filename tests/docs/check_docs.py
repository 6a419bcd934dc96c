#!/usr/bin/env python3
"""Keeps README.md and docs/*.md in step with the code they describe.

    check_docs.py SOURCE_DIR BUILD_DIR

(PYTHONPATH must reach the built package: BUILD_DIR/python.) For each file:
  - every path it names in backquotes under one of the project's rooms
    (`examples/python/launch.py`, `deploy/x.yaml`) exists;
  - every ```python block parses, and every `paramcast.X.Y` it uses and
    every name it imports from paramcast exists in the built package;
  - every shell line that runs a ParamCast tool (paramcast, paramcast-trainer,
    paramcast-worker, build/bin/...) names a tool that exists and only
    flags (and a subcommand) its --help lists;
  - every ```yaml block of a deployment file loads through the real config
    loader (the keys, values and files it names), in a folder where the
    file's runnable blocks ran before it;
  - a block right after a line `<!-- docs-check: run -->` runs (sh under
    bash, python under this interpreter) in that folder and must exit 0.
Each problem is printed as FILE:LINE: what is wrong; the exit code is the
number of problems (0: the docs match the code).
"""
import ast
import os
import re
import shlex
import subprocess
import sys
import tempfile

ROOMS = ("common/", "schemas/", "trainer_side/", "inference_side/", "deploy/", "tests/", "docs/", "bench/",
         "examples/", "python/", "cmake/", ".ci/")
TOOLS = ("paramcast", "paramcast-trainer", "paramcast-worker", "paramcast-bench", "paramcast-plan-bench",
         "paramcast-gpu-bench", "paramcast-transform-bench")
CONFIG_SECTIONS = {"publisher", "subscriber", "control", "data_plane", "auth", "trainer", "worker", "metrics",
                   "logging", "deployment"}
RUN_MARK = "<!-- docs-check: run -->"


class Doc:
    def __init__(self, path, rel):
        self.path, self.rel = path, rel
        with open(path, encoding="utf-8") as f:
            self.lines = f.read().split("\n")
        self.problems = []

    def problem(self, line, what):
        self.problems.append(f"{self.rel}:{line}: {what}")

    def blocks(self):
        """(language, first line number, text, runnable) of each fenced block."""
        out, i = [], 0
        while i < len(self.lines):
            m = re.match(r"^```(\w*)\s*$", self.lines[i])
            if not m:
                i += 1
                continue
            start, lang = i, m.group(1)
            j = i + 1
            while j < len(self.lines) and not self.lines[j].startswith("```"):
                j += 1
            runnable = start > 0 and self.lines[start - 1].strip() == RUN_MARK
            out.append((lang, start + 2, "\n".join(self.lines[start + 1:j]), runnable))
            i = j + 1
        return out


def check_paths(doc, root):
    for n, line in enumerate(doc.lines, 1):
        for quoted in re.findall(r"`([^`\s]+)`", line):
            path = quoted.rstrip(".,:;)")
            if not path.startswith(ROOMS) or re.search(r"[<>{}*?\[\]$]|\.\.\.", path):
                continue
            path = path.split(":")[0]  # file:line, file:symbol
            if not os.path.exists(os.path.join(root, path)):
                doc.problem(n, f"`{path}` does not exist (moved or renamed? update the text)")


def resolve(dotted):
    """Whether paramcast.<dotted> exists in the built package (submodules imported as needed)."""
    import importlib
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for k, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[:k + 1]))
        except ImportError:
            return False
    return True


def check_python(doc, line, text):
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        doc.problem(line + (e.lineno or 1) - 1, f"python block does not parse: {e.msg}")
        return
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Attribute):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "paramcast":
                names.append("paramcast." + ".".join(reversed(chain)))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "paramcast":
            names += [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] == "paramcast"]
        for name in names:
            if not resolve(name):
                doc.problem(line + node.lineno - 1, f"{name} does not exist in the paramcast package")


def tool_help(build, tool, sub, cache):
    key = (tool, sub)
    if key not in cache:
        path = os.path.join(build, "bin", tool)
        if not os.path.exists(path):
            cache[key] = None
        else:
            args = [path] + ([sub] if sub else []) + ["--help"]
            p = subprocess.run(args, capture_output=True, text=True, timeout=30)
            cache[key] = p.stdout + p.stderr
    return cache[key]


def check_shell(doc, line, text, build, cache):
    for k, raw in enumerate(text.split("\n")):
        cmd = raw.split(" #")[0].strip()
        if cmd.startswith("$ "):
            cmd = cmd[2:]
        try:
            words = shlex.split(cmd)
        except ValueError:
            continue
        for w in range(len(words)):
            tool = words[w].rsplit("/", 1)[-1]
            if tool not in TOOLS or (w > 0 and words[w - 1] not in ("|", "&&", ";", "sudo", "exec")
                                     and "=" not in words[w - 1]):
                continue
            sub = words[w + 1] if tool == "paramcast" and w + 1 < len(words) and not words[w + 1].startswith("-") \
                else ""
            helptext = tool_help(build, tool, sub, cache)
            if helptext is None:
                doc.problem(line + k, f"{tool}: no such tool in {build}/bin")
                continue
            if sub and f"  {sub} " not in tool_help(build, tool, "", cache):
                doc.problem(line + k, f"'{tool} {sub}': no such command (paramcast --help lists them)")
            for flag in words[w + 1:]:
                if flag in ("|", "&&", ";", ">", ">>"):
                    break
                name = flag.split("=")[0]
                if name.startswith("--") and name != "--help" and not re.search(rf"{re.escape(name)}\b", helptext):
                    doc.problem(line + k, f"{tool}{' ' + sub if sub else ''}: {name} is not one of its flags "
                                          f"(its --help lists them)")


def check_yaml(doc, line, text, workdir):
    import yaml
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        doc.problem(line, f"yaml block does not parse: {e}")
        return
    if not isinstance(data, dict) or not set(data) <= CONFIG_SECTIONS:
        return  # not a deployment file (or a fragment of one of another kind)
    import paramcast
    path = os.path.join(workdir, "docs-check.yaml")
    with open(path, "w") as f:
        f.write(text)
    try:
        paramcast._core.load_config_file(path)
    except Exception as e:  # the loader's ConfigError names the key and what it expected
        doc.problem(line, f"yaml block is refused by the config loader: {e}")


def run_block(doc, line, lang, text, workdir, env):
    if lang in ("sh", "bash", ""):
        args = ["bash", "-euo", "pipefail", "-c", text]
    elif lang == "python":
        args = [sys.executable, "-c", text]
    else:
        doc.problem(line, f"a runnable block must be sh or python, not '{lang}'")
        return
    try:
        p = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        doc.problem(line, "runnable block did not finish within 120 s")
        return
    if p.returncode != 0:
        doc.problem(line, f"runnable block exited {p.returncode}:\n{(p.stdout + p.stderr)[-2000:]}")


def main():
    root, build = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    files = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(root, "docs"))
                                   if f.endswith(".md"))
    env = dict(os.environ, PATH=os.path.join(build, "bin") + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=os.pathsep.join([os.path.join(build, "python")] +
                                          [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
               PARAMCAST_SOURCE_DIR=root)
    cache, problems, counts = {}, [], {"blocks": 0, "run": 0}
    for rel in files:
        doc = Doc(os.path.join(root, rel), rel)
        check_paths(doc, root)
        with tempfile.TemporaryDirectory(prefix="paramcast-docs-") as workdir:
            for lang, line, text, runnable in doc.blocks():
                counts["blocks"] += 1
                if runnable:
                    counts["run"] += 1
                    run_block(doc, line, lang, text, workdir, env)
                if lang == "python":
                    check_python(doc, line, text)
                elif lang in ("sh", "bash", ""):
                    check_shell(doc, line, text, build, cache)
                elif lang == "yaml":
                    check_yaml(doc, line, text, workdir)
        problems += doc.problems
    for p in problems:
        print(p)
    print(f"{len(files)} files, {counts['blocks']} blocks ({counts['run']} run): "
          f"{len(problems)} problem(s)")
    return min(len(problems), 100)


if __name__ == "__main__":
    sys.exit(main())
