#!/usr/bin/env bash
# The local demo: builds what it needs, then runs one trainer publishing a
# 291-tensor synthetic LLM to seven workers on this machine over Gloo; every
# worker verifies every byte of every version. Extra arguments are passed to
# `paramcast launch` (e.g. another deployment file instead of the default).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/deploy/build.sh" "$root/build" -- paramcast paramcast-trainer paramcast-worker >/dev/null
exec "$root/build/bin/paramcast" launch "${1:-$root/deploy/local-cpu.yaml}"
