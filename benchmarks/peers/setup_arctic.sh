#!/usr/bin/env bash
# Builds SuffixDecoding (PyPI arctic-inference==0.3.0, from its sdist) and
# installs ADED's retriever (PyPI draftretriever==0.1.1, a prebuilt wheel) into
# .venv-peers next to an editable SSSD, so that benchmarks can run them all in
# one process (benchmarks/bench_peers.py; matplotlib draws its figure).
# arctic-inference's build imports torch, hence --no-build-isolation with the
# local CPU torch; --no-deps skips vLLM (only the CPU suffix-tree extension is
# used). Run it again after the C++ core changes: it rebuilds the editable sssd.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv-peers/bin/python ] || python3 -m venv .venv-peers
. .venv-peers/bin/activate
pip() { python -m pip --disable-pip-version-check -q "$@"; }
pip install torch==2.13.0 nanobind==2.9.2 setuptools wheel ninja cmake numpy tqdm "scikit-build-core>=0.10" "pybind11>=2.13"
python -c "import arctic_inference.suffix_decoding" 2>/dev/null || pip install --no-deps --no-build-isolation arctic-inference==0.3.0
pip install --no-deps draftretriever==0.1.1
# matplotlib draws the figure; transformers tokenizes the copy-heavy sets' reference answers
# (their chat templates), at the version constraints.txt pins for .venv.
pip install matplotlib "transformers==$(sed -n 's/^transformers==//p' constraints.txt)"
pip install --no-build-isolation -e . --config-settings=build-dir=build/peers-{wheel_tag}
python -c "import arctic_inference.suffix_decoding, draftretriever, sssd; print('arctic-inference, draftretriever OK; sssd', sssd.__version__)"
