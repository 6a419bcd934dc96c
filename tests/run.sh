#!/usr/bin/env bash
# Builds everything and runs the whole test suite:
#   1. the regular build (Release, -Wall -Wextra -Werror) and every ctest test,
#   2. the same suite built with AddressSanitizer + UndefinedBehaviorSanitizer,
#   3. the same suite built with ThreadSanitizer (third-party suppressions only:
#      tests/tsan.supp says why each is there),
#   4. the control-message fuzzer for a bounded time (FUZZ_SECONDS, default 60).
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

stage build "build: $root/build"
bash deploy/build.sh "$root/build" -DCMAKE_BUILD_TYPE=Release -DPARAMCAST_WERROR=ON
stage test "test: $root/build"
run_ctest "$root/build"
stage ""
if [ $quick -eq 1 ]; then summary; exit 0; fi

stage asan-build "build under ASan + UBSan: $root/build-asan"
bash deploy/build.sh "$root/build-asan" -DPARAMCAST_SANITIZE=address,undefined -DPARAMCAST_BUILD_BENCH=OFF \
  -DPARAMCAST_WERROR=ON
stage asan-test "test under ASan + UBSan"
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  run_ctest "$root/build-asan"

stage tsan-build "build under ThreadSanitizer: $root/build-tsan"
bash deploy/build.sh "$root/build-tsan" -DPARAMCAST_SANITIZE=thread -DPARAMCAST_BUILD_BENCH=OFF -DPARAMCAST_WERROR=ON
stage tsan-test "test under ThreadSanitizer"
TSAN_OPTIONS="suppressions=$root/tests/tsan.supp:halt_on_error=1:history_size=4" run_ctest "$root/build-tsan"

if command -v clang++ >/dev/null; then
  stage fuzz "fuzz the control-message decoders for ${FUZZ_SECONDS:-60} s"
  bash deploy/build.sh "$root/build-fuzz" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang \
    -DPARAMCAST_BUILD_FUZZ=ON -DPARAMCAST_BUILD_TESTS=OFF -DPARAMCAST_BUILD_BENCH=OFF -DPARAMCAST_WERROR=ON -- control_fuzzer
  bash tests/fuzz/run.sh "$root/build-fuzz" "${FUZZ_SECONDS:-60}"
fi
stage ""
summary
