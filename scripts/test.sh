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
venv="${VIRTUAL_ENV:-$PWD/.venv}"  # the environment setup.sh installed into
py="$venv/bin/python"
# Which module may import which (pyproject.toml [tool.importlinter]), lint and format (ruff,
# [tool.ruff]): each failure fails the run before the tests.
"$venv/bin/lint-imports"
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
rc=0
"$py" -m pytest -q "$@" || rc=$?
# pytest exits 5 when it collected no tests (e.g. a -k filter matched nothing).
if [ "$rc" -eq 5 ]; then rc=0; fi
exit "$rc"
