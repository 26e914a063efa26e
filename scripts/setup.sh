#!/usr/bin/env bash
# Creates .venv (unless a virtual environment is already active) and installs
# SSSD with everything it needs, offline-friendly: the build tools first, then
# the project without build isolation. Idempotent: rerunning is cheap.
#   bash scripts/setup.sh          # the package + runtime dependencies
#   bash scripts/setup.sh --test   # ... + test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
for arg in "$@"; do
  case "$arg" in
    --test) extras="test" ;;
    *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
pip() { python -m pip --disable-pip-version-check -q "$@"; }

pip install "scikit-build-core>=0.10" "pybind11>=2.13" cmake ninja
if [ -n "$extras" ]; then
  pip install --no-build-isolation -e ".[$extras]"
else
  pip install --no-build-isolation -e .
fi
