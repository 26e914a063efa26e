#!/usr/bin/env bash
# Builds the C++ core with AddressSanitizer + UndefinedBehaviorSanitizer and
# runs, under them, the C++ unit tests (ctest) and the Python tests of the
# core, the datastore, the drafter and the merge. Any sanitizer report fails.
#
# The sanitized build lives in build/sanitize (its own CMake build directory)
# and is loaded through PYTHONPATH: the normal editable install in .venv is
# neither rebuilt nor changed. Python is not instrumented, so libasan is
# preloaded (LD_PRELOAD) for the extension module.
#
# Usage: bash scripts/sanitize.sh [extra pytest arguments]
# Needs: the .venv of scripts/setup.sh, g++, and GoogleTest (Debian:
# libgtest-dev; installed here with apt-get when missing and running as root).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv="${VIRTUAL_ENV:-$root/.venv}"
py="$venv/bin/python"
build="$root/build/sanitize"

if [ ! -x "$py" ]; then
  echo "sanitize.sh: no Python environment at $venv (run scripts/setup.sh first)" >&2
  exit 1
fi

# GoogleTest for the C++ unit tests.
if [ ! -e /usr/include/gtest/gtest.h ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing libgtest-dev"
    apt-get install -y -q libgtest-dev >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libgtest-dev >/dev/null; }
  else
    echo "sanitize.sh: GoogleTest is missing (Debian/Ubuntu: apt-get install libgtest-dev)" >&2
    exit 1
  fi
fi

cmake="$(command -v cmake || true)"
[ -x "$venv/bin/cmake" ] && cmake="$venv/bin/cmake"
generator=()
if command -v ninja >/dev/null || [ -x "$venv/bin/ninja" ]; then
  generator=(-G Ninja)
  [ -x "$venv/bin/ninja" ] && generator+=(-DCMAKE_MAKE_PROGRAM="$venv/bin/ninja")
fi
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined"

echo "== configuring and building the sanitized core in $build"
"$cmake" -S "$root" -B "$build" "${generator[@]}" -Wno-dev \
  -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_C_FLAGS="-O1 -g -fno-omit-frame-pointer $san" \
  -DCMAKE_CXX_FLAGS="-O1 -g -fno-omit-frame-pointer $san" \
  -DCMAKE_EXE_LINKER_FLAGS="$san" -DCMAKE_SHARED_LINKER_FLAGS="$san" -DCMAKE_MODULE_LINKER_FLAGS="$san" \
  -DSKBUILD_PROJECT_NAME=sssd -DSKBUILD_PROJECT_VERSION=0.0.0 \
  -DSSSD_BUILD_TESTS=ON \
  -DPython_EXECUTABLE="$py" \
  -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)" >/dev/null
"$cmake" --build "$build" -j "$(nproc)"

# The package as the wheel lays it out (sssd.datastore_builder, ...), its
# Python files linked from the source tree, the sanitized _core beside them.
pkg="$build/python"
rm -rf "$pkg"
mkdir -p "$pkg/sssd"
# Gone again at the end: the editable install presents the repository root as a location of the
# sssd package, so links left here would read as modules of it (lint-imports walks them).
trap 'rm -rf "$pkg"' EXIT
for f in "$root"/sssd/*; do  # modules and subpackages (commands, models, data), not a built _core
  case "$(basename "$f")" in _core*|__pycache__) continue ;; esac
  ln -s "$f" "$pkg/sssd/"
done
ln -s "$root/datastore_builder" "$pkg/sssd/datastore_builder"
ln -s "$root/calibration" "$pkg/sssd/calibration"
ln -s "$root/serving" "$pkg/sssd/serving"
ln -s "$build"/_core*.so "$pkg/sssd/"
# The editable install puts a finder for sssd ahead of PYTHONPATH; drop it
# in every interpreter (tests start child interpreters), after .pth files ran.
cat >"$pkg/sitecustomize.py" <<'EOF'
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "_editable" not in type(f).__module__]
EOF

logs="$build/reports"
rm -rf "$logs"
mkdir -p "$logs"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$logs/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$logs/ubsan"
export PYTHONPATH="$pkg${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
export SSSD_SANITIZED=1  # tests that cannot run under ASan (address-space limits) skip

rc=0
echo "== C++ unit tests (ctest)"
(cd "$build" && ctest --output-on-failure -j "$(nproc)") || rc=1

echo "== Python tests against the sanitized core"
# From the build directory: from the repository root, the source tree's
# sssd/ (first on sys.path) would shadow the staged package. libstdc++ is
# preloaded too: ASan intercepts __cxa_throw only if it is there at start-up
# (python does not link it), else the first C++ exception aborts.
preload="$(gcc -print-file-name=libasan.so) $(readlink -f "$(gcc -print-file-name=libstdc++.so)")"
cd "$build"
LD_PRELOAD="$preload" "$py" -c '
import sys, sssd._core as c
assert c.__file__.startswith(sys.argv[1]), f"not the sanitized core: {c.__file__}"
print("sssd._core:", c.__file__)' "$pkg" || rc=1
tests=(test_suffix_array.py test_request_trie.py test_copy_source.py test_tree.py test_merge.py test_datastore.py test_datastore_fuzz.py
       test_drafter.py test_source_evidence.py)
LD_PRELOAD="$preload" "$py" -m pytest -q -p no:cacheprovider --rootdir="$root" \
  "${tests[@]/#/$root/tests/}" "$@" || rc=1
cd "$root"

reports=$(find "$logs" -type f | wc -l)
if [ "$reports" -gt 0 ]; then
  echo "== $reports sanitizer report(s):"
  for f in "$logs"/*; do echo "--- $f"; head -60 "$f"; done
  rc=1
else
  echo "== 0 sanitizer reports"
fi
exit "$rc"
