#!/usr/bin/env bash
# Sets up SSSD (scripts/setup.sh) and runs the test suite. Extra arguments
# go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py="${VIRTUAL_ENV:-$PWD/.venv}/bin/python"  # the environment setup.sh installed into
rc=0
"$py" -m pytest -q "$@" || rc=$?
# pytest exits 5 when it collected no tests (e.g. a -k filter matched nothing).
if [ "$rc" -eq 5 ]; then rc=0; fi
exit "$rc"
