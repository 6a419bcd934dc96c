#!/usr/bin/env bash
# A C++ user's path: `cmake --install` into a fresh prefix, then a program
# outside the tree (examples/cpp) built against it twice, with
# find_package(paramcast) and with pkg-config, and the find_package build run
# as a trainer and an engine exchanging three verified versions.
#   install_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build="$1"; src="$2"
work="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
prefix="$work/prefix"

cmake --install "$build" --prefix "$prefix" >"$work/install.log"
for f in include/paramcast/publisher.h include/paramcast/subscriber.h lib/libparamcast.so \
         lib/cmake/paramcast/paramcastConfig.cmake lib/pkgconfig/paramcast.pc \
         bin/paramcast bin/paramcast-trainer bin/paramcast-worker; do
  [ -e "$prefix/$f" ] || { echo "install_test: $prefix/$f was not installed"; exit 1; }
done
# The installed headers include only each other and the standard library.
if grep -rn '#include "' "$prefix/include" | grep -v '#include "paramcast/'; then
  echo "install_test: an installed header includes something outside <paramcast/...>"; exit 1
fi

# find_package(paramcast), from a copy of the example outside the tree.
cp -r "$src/examples/cpp" "$work/example"
cmake -S "$work/example" -B "$work/example-build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" >"$work/configure.log" || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/example-build" >"$work/build.log" || { cat "$work/build.log"; exit 1; }
# pkg-config, with the compiler alone.
PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --exists paramcast
g++ -std=c++20 "$work/example/weights_roundtrip.cc" -o "$work/roundtrip-pc" \
  $(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --cflags --libs paramcast)
# Nothing from the build tree is needed at run time.
deps="$(ldd "$work/example-build/weights_roundtrip")"  # captured: no SIGPIPE under pipefail
if grep -qF "$build" <<< "$deps"; then
  echo "install_test: the example loads a library from the build tree"; exit 1
fi

run_pair() {  # $1: the program; three versions from its trainer to its engine
  local bin="$1" ep="$work/endpoint.$RANDOM"
  "$bin" publish "$ep" 3 >"$work/pub.log" 2>&1 &
  local pub=$!
  for _ in $(seq 1 300); do [ -s "$ep" ] && break; sleep 0.1; done
  [ -s "$ep" ] || { echo "install_test: $bin publish wrote no endpoint"; cat "$work/pub.log"; exit 1; }
  if ! "$bin" engine "$(cat "$ep")" 3 >"$work/engine.log" 2>&1; then
    echo "install_test: engine failed"; cat "$work/engine.log" "$work/pub.log"; exit 1
  fi
  wait $pub || { echo "install_test: publisher failed"; cat "$work/pub.log"; exit 1; }
  grep -q "engine has version 3, version 3, consistent" "$work/engine.log" || { cat "$work/engine.log"; exit 1; }
}
run_pair "$work/example-build/weights_roundtrip"
run_pair "$work/roundtrip-pc"
echo "install_test: find_package and pkg-config builds each moved 3 verified versions"
