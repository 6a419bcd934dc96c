#!/usr/bin/env bash
# Runs the control-message fuzzer for a bounded time from the checked-in seed
# corpus, plus every regression input. usage: run.sh BUILD_DIR [SECONDS]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build="$1"
secs="${2:-60}"
fuzzer="$build/bin/control_fuzzer"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if [ -d "$here/regressions" ] && [ -n "$(ls -A "$here/regressions" 2>/dev/null)" ]; then
  "$fuzzer" "$here"/regressions/*    # each past crash must now pass
fi
ASAN_OPTIONS=detect_leaks=0 "$fuzzer" -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 \
  -artifact_prefix="$work/" -print_final_stats=1 "$work" "$here/corpus" 2>&1 | tail -25
echo "fuzz: ${secs}s without a crash"
