#!/usr/bin/env bash
# Builds everything and runs the whole test suite:
#   1. the regular build (Release, -Wall -Wextra -Werror) and every ctest test,
#   2. the same suite built with AddressSanitizer + UndefinedBehaviorSanitizer,
#   3. the same suite built with ThreadSanitizer (third-party suppressions only:
#      tests/tsan.supp says why each is there),
#   4. the control-message fuzzer for a bounded time (FUZZ_SECONDS, default 60).
# Each later build runs beside the suite before it (build_beside, below).
# `--quick` runs step 1 only. NCCL tests skip, saying why, where no GPU exists.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
quick=0
[ "${1:-}" = "--quick" ] && quick=1

passed=0; failed=0; skipped=0
run_ctest() {
  # -j1: several tests start 8 processes each and assert time bounds.
  local rc=0
  ctest --test-dir "$1" --output-on-failure --timeout 600 -j1 | tee "$1/ctest.out" || rc=$?
  local total bad skip
  total=$(sed -n 's/.*tests failed out of \([0-9]*\).*/\1/p' "$1/ctest.out" | tail -1)
  bad=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed.*/\1/p' "$1/ctest.out" | tail -1)
  skip=$(grep -c "(Skipped)" "$1/ctest.out" || true)
  passed=$((passed + ${total:-0} - ${bad:-0} - skip)); failed=$((failed + ${bad:-0})); skipped=$((skipped + skip))
  # Say why tests were skipped (e.g. the NCCL suite on a machine without a GPU).
  local log="$1/Testing/Temporary/LastTest.log"
  if grep -q ": Skipped$" "$log" 2>/dev/null; then
    echo "Skipped tests, and why:"
    grep -h -A1 ": Skipped$" "$log" | grep -v -e "^--$" -e ": Skipped$" | sort | uniq -c
  fi
  return $rc
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
# The sanitizer and fuzzer builds run beside the suite before them, at nice
# 19: the tests are mostly waiting (timeouts, peers, links) and keep the CPU
# they need (their time bounds hold beside a CPU hog at full priority, and
# this one yields), while the build takes what is left, two compiles at a
# time. The build is a job of its own process group (set -m) but stays in
# this session: with the kernel's autogroup scheduling a new session (setsid)
# would be a group of its own, given half the CPU whatever its nice value.
# Each build's output goes to DIR/ci-build.log, shown when it fails.
beside_pid=""; beside_dir=""; beside_name=""
build_beside() {  # NAME DIR deploy/build.sh-ARGS...
  beside_name="$1"; beside_dir="$2"; shift 2
  mkdir -p "$beside_dir"
  set -m
  CMAKE_BUILD_PARALLEL_LEVEL=2 nice -n 19 bash -c 't=$SECONDS; bash deploy/build.sh "$@" || exit; echo "built in $((SECONDS - t)) s"' \
    build_beside "$beside_dir" "$@" > "$beside_dir/ci-build.log" 2>&1 &
  beside_pid=$!
  set +m
}
wait_beside() {
  local rc=0 t=$SECONDS log="$beside_dir/ci-build.log"
  wait "$beside_pid" || rc=$?
  beside_pid=""
  if [ $rc -ne 0 ]; then
    echo "$beside_name failed (exit $rc); $log, from its first error:"
    if grep -q "^FAILED:" "$log"; then sed -n "/^FAILED:/,\$p" "$log" | head -150 || true; else tail -80 "$log"; fi
    summary
    exit $rc
  fi
  stages+=" $beside_name=$(sed -n 's/^built in \([0-9]*\) s$/\1/p' "$log")(waited $((SECONDS - t)))"
}
# A failing stage ends the run: the build beside it goes too.
trap '[ -n "$beside_pid" ] && kill -- -"$beside_pid" 2>/dev/null; true' EXIT

stage build "build: $root/build"
bash deploy/build.sh "$root/build" -DCMAKE_BUILD_TYPE=Release -DPARAMCAST_WERROR=ON
stage test "test: $root/build"
if [ $quick -eq 0 ]; then
  build_beside asan-build "$root/build-asan" -DPARAMCAST_SANITIZE=address,undefined -DPARAMCAST_BUILD_BENCH=OFF \
    -DPARAMCAST_WERROR=ON
fi
run_ctest "$root/build"
stage ""
if [ $quick -eq 1 ]; then summary; exit 0; fi

echo "== waiting for the ASan + UBSan build: $root/build-asan"
wait_beside
build_beside tsan-build "$root/build-tsan" -DPARAMCAST_SANITIZE=thread -DPARAMCAST_BUILD_BENCH=OFF -DPARAMCAST_WERROR=ON
stage asan-test "test under ASan + UBSan: $root/build-asan"
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  run_ctest "$root/build-asan"
stage ""

echo "== waiting for the ThreadSanitizer build: $root/build-tsan"
wait_beside
fuzz=0
if command -v clang++ >/dev/null; then
  fuzz=1
  build_beside fuzz-build "$root/build-fuzz" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang \
    -DPARAMCAST_BUILD_FUZZ=ON -DPARAMCAST_BUILD_TESTS=OFF -DPARAMCAST_BUILD_BENCH=OFF -DPARAMCAST_WERROR=ON -- control_fuzzer
fi
stage tsan-test "test under ThreadSanitizer: $root/build-tsan"
TSAN_OPTIONS="suppressions=$root/tests/tsan.supp:halt_on_error=1:history_size=4" run_ctest "$root/build-tsan"
stage ""

if [ $fuzz -eq 1 ]; then
  echo "== waiting for the fuzzer build: $root/build-fuzz"
  wait_beside
  stage fuzz "fuzz the control-message decoders for ${FUZZ_SECONDS:-60} s"
  bash tests/fuzz/run.sh "$root/build-fuzz" "${FUZZ_SECONDS:-60}"
  stage ""
fi
summary
