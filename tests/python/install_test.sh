#!/usr/bin/env bash
# A Python user's path, on both interpreters the project supports:
#   1. the python3 on PATH (pyenv's, with a current PyTorch): `python3 -m build --wheel`, then the wheel
#      installed into a venv that sees that PyTorch;
#   2. Debian's /usr/bin/python3 (PyTorch 1.13): a venv that sees it, with `pip install <repo>`, or
#      the wheel of step 1 where both interpreters share one CPython ABI (this machine's case);
#   3. a venv with no PyTorch at all: the example says PyTorch is missing, in so many words;
#   4. the README's quick start on the python3 on PATH: a fresh venv (nothing of the system's),
#      `pip install <repo>`, `pip install torch==<that python's torch>` (which brings no numpy), and
#      examples/python/launch.py runs to identical logits.
# In each venv, from a directory outside the checkout: `import paramcast` comes from the venv, a
# publisher and an engine move a verified update, the tools are on the venv's PATH, and the example
# trainer finds the installed package (never build/python: it is not on the path here).
#   install_test.sh SOURCE_DIR WORK_DIR
set -euo pipefail
src="$1"; work="$2"
rm -rf "$work"; mkdir -p "$work/run"
cd "$work/run"   # nothing of the checkout on sys.path
# pip builds in an isolated environment with the build backend from PyPI.
if ! python3 -m pip download --quiet --no-deps --dest "$work/probe" scikit-build-core >/dev/null 2>&1; then
  echo "tests/python/install_test.sh: Skipped"
  echo "PyPI is unreachable: pip cannot fetch the build backend (scikit-build-core) for pip install ."
  exit 77
fi

check_venv() {  # $1: venv; $2: the torch version it must see (a prefix)
  local py="$1/bin/python"
  "$py" - "$1" "$2" <<'PY'
import os, sys
venv, want_torch = sys.argv[1], sys.argv[2]
import paramcast, torch
assert os.path.realpath(paramcast.__file__).startswith(os.path.realpath(venv)), paramcast.__file__
assert torch.__version__.startswith(want_torch), torch.__version__
from paramcast.integrations import vllm
cfg = {"control": {"endpoint": "tcp://127.0.0.1:*", "heartbeat_interval": "100ms", "heartbeat_timeout": "2s"},
       "data_plane": {"backend": "gloo", "checksum": "xxh64"}, "publisher": {"subscribers": 1},
       "logging": {"level": "warn"}}
pub = paramcast.Publisher(cfg)
sub = paramcast.Subscriber(dict(cfg, control={**cfg["control"], "endpoint": pub.endpoint}), "engine-1")
dst = torch.zeros(1000, dtype=torch.bfloat16)
sub.register({"w": dst})
sub.start(); pub.start()
src = torch.randn(1000).to(torch.bfloat16)
r = pub.weight_update({"w": src})
assert r.ok and torch.equal(dst, src), r
sub.stop(); pub.close()
print(f"{venv}: paramcast {paramcast.__file__}, torch {torch.__version__}: update v{r.version} bit-exact")
PY
  # A captured output, not `cmd | grep -q`: under pipefail grep's early exit would fail the writer (SIGPIPE).
  local help; help="$("$1/bin/paramcast" --help)"
  grep -q "launch FILE.yaml" <<< "$help"
  [ -x "$1/bin/paramcast-trainer" ] && [ -x "$1/bin/paramcast-worker" ]
  # The example's trainer alone (no engines) gets as far as binding: it found paramcast and torch.
  timeout 60 "$py" "$src/examples/python/trainer.py" --engines 1 --steps 1 > "$work/example.out" 2>&1 &
  local pid=$!
  for _ in $(seq 1 300); do grep -q "^endpoint " "$work/example.out" && break; sleep 0.1; done
  kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true
  grep -q "^endpoint tcp://" "$work/example.out" || { echo "example trainer did not start:"; cat "$work/example.out"; exit 1; }
}

current="$(command -v python3)"
# One compiler for every build: Debian's interpreter would otherwise hand CMake its own compiler path
# (x86_64-linux-gnu-g++), and a changed compiler makes CMake start the build directory over.
export CC="${CC:-$(command -v gcc)}" CXX="${CXX:-$(command -v g++)}"
# The CUDA kernels for one architecture (scikit-build-core passes CMAKE_ARGS to CMake): the same code
# is compiled and linked as for a user's two, in half the nvcc time (CI's critical path runs here).
export CMAKE_ARGS="${CMAKE_ARGS:-} -DPARAMCAST_CUDA_ARCHITECTURES=90"
ext() { "$1" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))'; }
# Where both interpreters take the same extension (one CPython ABI), Debian's venv takes the wheel
# built above: the same binary a pip install there would build (the regular build compiles the
# package against Debian's headers, and its suite runs under Debian's PyTorch). Recompiling the
# bindings here cost CI several minutes beside the ThreadSanitizer suite.
same_abi=0
[ "$(ext "$current")" = "$(ext /usr/bin/python3)" ] && same_abi=1
# Each step's start, in seconds since the test began: where a slow machine or PyPI spends the time.
step() { echo "== [${SECONDS} s] $*"; }
if [ "$(readlink -f "$current")" != "$(readlink -f /usr/bin/python3)" ]; then
  step "$current: python3 -m build --wheel, installed into a venv"
  "$current" -m build --wheel --outdir "$work/dist" -C build-dir="$work/build-current" "$src" > "$work/build-current.log" 2>&1 \
    || { tail -40 "$work/build-current.log"; exit 1; }
  wheel=$(ls "$work"/dist/paramcast-*.whl)
  # The listing is captured first: `unzip -l | grep -q` under pipefail fails whenever grep exits
  # before unzip has written everything (SIGPIPE), which depends on timing.
  listing="$(unzip -l "$wheel")"
  grep -q "paramcast/_core.cpython" <<< "$listing" || { echo "the wheel has no extension"; exit 1; }
  grep -q "paramcast/integrations/vllm.py" <<< "$listing" || { echo "the wheel has no vLLM backend"; exit 1; }
  "$current" -m venv --system-site-packages "$work/venv-current"
  "$work/venv-current/bin/pip" install --quiet --disable-pip-version-check "$wheel"
  check_venv "$work/venv-current" "$("$current" -c 'import torch; print(torch.__version__)')"

  step "a venv without PyTorch: the example names what is missing"
  "$current" -m venv "$work/venv-bare"
  "$work/venv-bare/bin/pip" install --quiet --disable-pip-version-check "$wheel"
  if "$work/venv-bare/bin/python" "$src/examples/python/trainer.py" > "$work/bare.out" 2>&1; then
    echo "the example ran without PyTorch"; exit 1
  fi
  grep -q "this example needs PyTorch" "$work/bare.out" || { cat "$work/bare.out"; exit 1; }
  "$work/venv-bare/bin/python" -c "import paramcast" # the package itself imports without PyTorch

  # The same build directory as the wheel's above: pip's build recompiles nothing of the project.
  torch_want="$("$current" -c 'import torch; print(torch.__version__.split("+")[0])')"
  step "a fresh venv: pip install $src, pip install torch==$torch_want, examples/python/launch.py"
  "$current" -m venv "$work/venv-fresh"
  "$work/venv-fresh/bin/pip" install --quiet --disable-pip-version-check --config-settings=build-dir="$work/build-current" "$src" \
    > "$work/build-fresh.log" 2>&1 || { tail -40 "$work/build-fresh.log"; exit 1; }
  "$work/venv-fresh/bin/pip" install --quiet --disable-pip-version-check "torch==$torch_want" > "$work/torch-fresh.log" 2>&1 \
    || { tail -40 "$work/torch-fresh.log"; exit 1; }
  if "$work/venv-fresh/bin/python" -c "import numpy" 2>/dev/null; then
    echo "numpy is in the fresh venv: this check would not show that the examples run without it"; exit 1
  fi
  timeout 300 "$work/venv-fresh/bin/python" "$src/examples/python/launch.py" --engines 2 --steps 2 > "$work/fresh.out" 2>&1 \
    || { echo "launch.py failed in a fresh venv:"; cat "$work/fresh.out"; exit 1; }
  grep -q "logits identical" "$work/fresh.out" || { cat "$work/fresh.out"; exit 1; }
  grep -q "^launch: " "$work/fresh.out" && grep "^launch: " "$work/fresh.out"
fi

/usr/bin/python3 -m venv --system-site-packages "$work/venv-debian"
if [ $same_abi -eq 1 ] && [ -n "${wheel:-}" ]; then
  step "/usr/bin/python3 (the same ABI): pip install $(basename "$wheel")"
  "$work/venv-debian/bin/pip" install --quiet --disable-pip-version-check "$wheel" \
    > "$work/build-debian.log" 2>&1 || { tail -40 "$work/build-debian.log"; exit 1; }
else
  step "/usr/bin/python3: pip install $src"
  "$work/venv-debian/bin/pip" install --quiet --disable-pip-version-check --config-settings=build-dir="$work/build-debian" "$src" \
    > "$work/build-debian.log" 2>&1 || { tail -40 "$work/build-debian.log"; exit 1; }
fi
check_venv "$work/venv-debian" "1.13"
step "done"
echo "install_test: the wheel and pip install . work for both interpreters"
