#!/usr/bin/env bash
# Installs SSSD with its test dependencies into .venv and runs the test suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
rc=0
.venv/bin/python -m pytest -q "$@" || rc=$?
# pytest exits 5 when it collected no tests (e.g. a -k filter matched nothing).
if [ "$rc" -eq 5 ]; then rc=0; fi
exit "$rc"
