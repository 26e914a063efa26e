#!/usr/bin/env bash
# The prepared device run (issue 33), one command on a machine with a GPU, from the repository root:
#
#   SSSD_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_check.sh [gpu_check.py options]
#
# Installs any wheels carried under .whl/ (packages the machine lacks) into /tmp/site, builds and
# installs SSSD into the machine's Python (pip install --no-deps --no-build-isolation .), then runs
# benchmarks/gpu_check.py from outside the source tree (so the installed package is what runs).
# Everything lands in $OUT (default benchmarks/out): gpu_check.json, gpu_check.log, build.log.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
out="${OUT:-$repo/benchmarks/out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
t0=$(date +%s)
if ! CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$py" -m pip install --no-deps --no-build-isolation . >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  echo "gpu_check: building SSSD failed (the whole log: $out/build.log)" >&2
  exit 2
fi
echo "gpu_check: SSSD built and installed in $(( $(date +%s) - t0 )) s"
cd /tmp
set -o pipefail
PYTHONUNBUFFERED=1 "$py" "$repo/benchmarks/gpu_check.py" --out "$out/gpu_check.json" "$@" 2>&1 | tee "$out/gpu_check.log"
