#!/usr/bin/env bash
# Refreshes constraints.txt and constraints-vllm.txt, on purpose and only
# when the suite passes: resolves every dependency afresh within
# pyproject.toml's ranges in two new environments (.venv-refresh and
# .venv-vllm-refresh), runs the whole suite there, and only then writes the
# new pins. Review `git diff constraints*.txt` and commit it naming the
# versions that moved. To admit a new release of a library whose internals
# SSSD calls (torch, transformers, tokenizers, vLLM), first raise its upper
# bound in pyproject.toml. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .venv-refresh .venv-vllm-refresh
python3 -m venv .venv-refresh
( . .venv-refresh/bin/activate && SSSD_CONSTRAINTS=none bash scripts/setup.sh )
SSSD_VLLM_VENV=.venv-vllm-refresh SSSD_VLLM_CONSTRAINTS=none bash scripts/setup_vllm.sh
SSSD_VLLM_PYTHON="$PWD/.venv-vllm-refresh/bin/python" .venv-refresh/bin/python -m pytest -q "$@"

write() {  # write PYTHON FILE: the environment's versions, SSSD itself left out, torch without its +cpu tag
  { echo "# Exact versions the suite passed with; written by scripts/refresh_constraints.sh on $(date -u +%F)"
    echo "# ($("$1" -c 'import platform; print("Python", platform.python_version(), platform.machine())')). Do not edit by hand."
    "$1" -m pip freeze --exclude-editable | grep -v -i -E '^(sssd)==' | sed -E 's/^(torch==[^+]+)\+.*/\1/'
  } > "$2.new"
  mv "$2.new" "$2"
}
write .venv-refresh/bin/python constraints.txt
write .venv-vllm-refresh/bin/python constraints-vllm.txt
git --no-pager diff --stat -- constraints.txt constraints-vllm.txt || true
echo "constraints refreshed; the suite passed with them. Environments left in .venv-refresh and .venv-vllm-refresh."
