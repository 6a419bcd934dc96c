#!/usr/bin/env bash
# Builds everything and runs the whole test suite:
#   1. the regular build (Release, -Wall -Wextra -Werror) and every ctest test
#      (the Python API's tests two at a time, the rest one at a time),
#   2. the same suite built with AddressSanitizer + UndefinedBehaviorSanitizer
#      (by clang, with libFuzzer's coverage, where clang is installed: the
#      same tree holds the control-message fuzzer),
#   3. the same suite built with ThreadSanitizer (third-party suppressions only:
#      tests/tsan.supp says why each is there),
#   4. the control-message fuzzer for a bounded time (FUZZ_SECONDS, default 60).
# The work that needs the CPU runs beside a suite that mostly waits (`beside`,
# below): each sanitizer build beside the suite before it, the pip-install
# test (a Release build of the wheel's own) beside the last one.
# `--quick` runs step 1 only. NCCL tests skip, saying why, where no GPU exists.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
quick=0
[ "${1:-}" = "--quick" ] && quick=1

passed=0; failed=0; skipped=0
# count_ctest OUT LASTLOG: adds a ctest run's counts (its output OUT) and says
# why tests were skipped (e.g. the NCCL suite on a machine without a GPU).
count_ctest() {
  local total bad skip
  total=$(sed -n 's/.*tests failed out of \([0-9]*\).*/\1/p' "$1" | tail -1)
  bad=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed.*/\1/p' "$1" | tail -1)
  skip=$(grep -c "(Skipped)" "$1" || true)
  passed=$((passed + ${total:-0} - ${bad:-0} - skip)); failed=$((failed + ${bad:-0})); skipped=$((skipped + skip))
  if grep -q ": Skipped$" "$2" 2>/dev/null; then
    echo "Skipped tests, and why:"
    grep -h -A1 ": Skipped$" "$2" | grep -v -e "^--$" -e ": Skipped$" | sort | uniq -c || true
  fi
}
# run_ctest DIR [-jN] [CTEST_ARGS...]: the suite of DIR (or the tests CTEST_ARGS
# pick), one test at a time unless -jN; its output in DIR/ctest.out (ctest-jN.out).
run_ctest() {
  local dir="$1" rc=0 jobs=1 out
  shift
  # -j1 by default: several tests start 8 processes each and assert time bounds.
  if [[ "${1:-}" == -j* ]]; then jobs="${1#-j}"; shift; fi
  out="$dir/ctest.out"; [ "$jobs" != 1 ] && out="$dir/ctest-j$jobs.out"
  ctest --test-dir "$dir" --output-on-failure --timeout 600 -j"$jobs" "$@" | tee "$out" || rc=$?
  count_ctest "$out" "$dir/Testing/Temporary/LastTest.log"
  [ $rc -ne 0 ] && failure_digest "$out"
  return $rc
}
# failure_digest OUT: the assertions that failed, last, where a log shown by
# its head and tail still shows them (a failing process test's own output can
# run to thousands of lines between them).
failure_digest() {
  echo "Failed assertions ($1), the first 40 lines:"
  grep -a -A6 -e ": Failure$" -e "^\[  FAILED  \].*ms)$" -e "Exception: " -e "^E   " "$1" | cut -c1-300 | head -40 || true
}
summary() { echo "tests: $passed passed, $failed failed, $skipped skipped"; echo "stage times (s):$stages"; }
# Each stage's wall time, printed at the end: CI's time budget is spent here.
stages=""; stage_start=$SECONDS; stage_name=""
stage() {
  [ -n "$stage_name" ] && stages+=" $stage_name=$((SECONDS - stage_start))"
  stage_name="$1"; stage_start=$SECONDS
  [ -n "$1" ] && echo "== $2"
  return 0
}

# beside NAME LOG COMMAND...: runs COMMAND (a function of this script or a
# program) in the background at nice 19, its output in LOG. The suites it runs
# beside are mostly waiting (timeouts, peers, links) and keep the CPU they need
# (their time bounds hold beside a CPU hog at full priority, and this one
# yields), while COMMAND takes what is left. The job is a process group of its
# own (set -m) but stays in this session: with the kernel's autogroup
# scheduling a new session (setsid) would be a group of its own, given half
# the CPU whatever its nice value. One job at a time; wait_beside ends it.
beside_pid=""; beside_log=""; beside_name=""
beside() {
  beside_name="$1"; beside_log="$2"; shift 2
  mkdir -p "$(dirname "$beside_log")"
  set -m
  (
    renice -n 19 -p "$BASHPID" > /dev/null
    t=$SECONDS
    "$@"
    echo "done in $((SECONDS - t)) s"
  ) > "$beside_log" 2>&1 &
  beside_pid=$!
  set +m
}
wait_beside() {
  local rc=0 t=$SECONDS
  wait "$beside_pid" || rc=$?
  beside_pid=""
  if [ $rc -ne 0 ]; then
    echo "$beside_name failed (exit $rc); $beside_log, from its first error:"
    if grep -q "^FAILED:" "$beside_log"; then sed -n "/^FAILED:/,\$p" "$beside_log" | head -150 || true
    else tail -80 "$beside_log"; fi
    summary
    exit $rc
  fi
  stages+=" $beside_name=$(sed -n 's/^done in \([0-9]*\) s$/\1/p' "$beside_log")(waited $((SECONDS - t)))"
}
# A failing stage ends the run: the job beside it goes too.
trap '[ -n "$beside_pid" ] && kill -- -"$beside_pid" 2>/dev/null; true' EXIT

# Two compiles at a time beside the tests (ninja would start three on 2 cores).
build_quietly() { CMAKE_BUILD_PARALLEL_LEVEL=2 bash deploy/build.sh "$@"; }
# The pip-install test (tests/python/install_test.sh) is one test of the
# regular build, run on its own; its output in build/ctest-pip.out. Its wheel
# build at nice 19 beside the ThreadSanitizer suite took 14.7 of its 19.7
# minutes in CI (2026-12-07): the timeout (30 minutes, the test's own) only
# guards against a hang, and once that suite ends the build has both cores.
pip_install_test=(-R '^python_pip_install$')
pip_install() {
  ctest --test-dir "$root/build" --output-on-failure --timeout 1800 "${pip_install_test[@]}" \
    > "$root/build/ctest-pip.out" 2>&1 || true
}
# With clang the ASan + UBSan tree is also the fuzzer's (PARAMCAST_BUILD_FUZZ:
# address,undefined and libFuzzer's coverage): one tree instead of two, which
# saved about 10 minutes of CI's 2 cores. Without clang it is GCC's, and no
# fuzzer runs.
fuzz=0
asan_compiler=()
if command -v clang++ > /dev/null; then
  fuzz=1
  asan_compiler=(-DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang -DPARAMCAST_BUILD_FUZZ=ON)
fi

stage build "build: $root/build"
bash deploy/build.sh "$root/build" -DCMAKE_BUILD_TYPE=Release -DPARAMCAST_WERROR=ON
stage test "test: $root/build"
if [ $quick -eq 1 ]; then
  run_ctest "$root/build"
  stage ""
  summary
  exit 0
fi
# The sanitized trees compile the CUDA kernels for one architecture: they link
# the NCCL plane but never run on a GPU (the GPU tests run the Release pack).
sanitized=(-DPARAMCAST_BUILD_BENCH=OFF -DPARAMCAST_WERROR=ON -DPARAMCAST_CUDA_ARCHITECTURES=90)
beside asan-build "$root/build-asan/ci-build.log" build_quietly "$root/build-asan" \
  -DPARAMCAST_SANITIZE=address,undefined "${asan_compiler[@]}" "${sanitized[@]}"
# The Python API's tests two at a time: each spends most of its wall time importing PyTorch and
# waiting on its engines (about 0.75 of a core at -j1), and their time bounds hold beside a CPU hog;
# a file with a tight bound (Ctrl-C within 1 s) is RUN_SERIAL (tests/python/CMakeLists.txt).
rc=0
run_ctest "$root/build" -E "^python_" || rc=$?
run_ctest "$root/build" -j2 -R "^python_" -E "${pip_install_test[1]}" || rc=$?
[ $rc -ne 0 ] && { summary; exit $rc; }
stage ""

echo "== waiting for the ASan + UBSan build: $root/build-asan"
wait_beside
beside tsan-build "$root/build-tsan/ci-build.log" build_quietly "$root/build-tsan" \
  -DPARAMCAST_SANITIZE=thread "${sanitized[@]}"
stage asan-test "test under ASan + UBSan: $root/build-asan"
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  run_ctest "$root/build-asan"
stage ""

echo "== waiting for the ThreadSanitizer build: $root/build-tsan"
wait_beside
beside pip-install "$root/build/ci-last.log" pip_install
stage tsan-test "test under ThreadSanitizer: $root/build-tsan"
TSAN_OPTIONS="suppressions=$root/tests/tsan.supp:halt_on_error=1:history_size=4" run_ctest "$root/build-tsan"
stage ""

echo "== waiting for the pip-install test"
wait_beside
echo "== the pip-install test (tests/python/install_test.sh), run beside the ThreadSanitizer suite:"
cat "$root/build/ctest-pip.out"
before=$failed
count_ctest "$root/build/ctest-pip.out" "$root/build/Testing/Temporary/LastTest.log"
# Failed, or ctest itself did not run (a build without the Python package has
# no such test: "No tests were found").
if [ $failed -ne $before ] || ! grep -q -e "tests failed out of" -e "No tests were found" "$root/build/ctest-pip.out"; then
  summary
  exit 1
fi
if [ $fuzz -eq 1 ]; then
  stage fuzz "fuzz the control-message decoders for ${FUZZ_SECONDS:-60} s"
  bash tests/fuzz/run.sh "$root/build-asan" "${FUZZ_SECONDS:-60}"
  stage ""
fi
summary
