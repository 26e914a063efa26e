#!/usr/bin/env bash
# Sets up SSSD (scripts/setup.sh) and runs the test suite. Extra arguments
# go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# vLLM (its own environment) for the vLLM integration test; skip with SSSD_SKIP_VLLM=1.
# If it cannot be installed, that test skips and says why; the rest still runs.
if [ "${SSSD_SKIP_VLLM:-0}" != 1 ]; then
  bash scripts/setup_vllm.sh || echo "WARNING: vLLM could not be set up; tests/test_vllm.py's integration test will skip"
fi
py="${VIRTUAL_ENV:-$PWD/.venv}/bin/python"  # the environment setup.sh installed into
rc=0
"$py" -m pytest -q "$@" || rc=$?
# pytest exits 5 when it collected no tests (e.g. a -k filter matched nothing).
if [ "$rc" -eq 5 ]; then rc=0; fi
exit "$rc"
