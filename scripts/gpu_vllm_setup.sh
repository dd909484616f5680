#!/usr/bin/env bash
# Install the vLLM CUDA build made by scripts/gpu_vllm_bundle.sh on the device machine (no network).
#
#   source scripts/gpu_vllm_setup.sh PARTS_DIR     # PARTS_DIR holds vllm-slim.tar.xz.part* and deps-site.tar.xz
#
# The bundle is vLLM 0.26.0's manylinux wheel (the last release built against torch 2.11.0 + CUDA 13,
# the device's torch) unpacked with its FlashAttention-2 kernel and Rust front end left out, plus the
# pure-Python and small compiled dependencies the device image lacks, both as xz tarballs (a wheel is
# deflate-compressed: xz makes the 290 MiB wheel 112 MiB, two carries). The parts arrive over several
# `run` calls (64 MiB each) and are joined here; the tarballs hold what `pip install --no-deps --target`
# would have written. Sets PYTHONPATH to the site directory and the repository.
set -euo pipefail
PARTS=${1:?usage: source scripts/gpu_vllm_setup.sh PARTS_DIR}
SITE=${VLLM_SITE:-/tmp/vllm-site}
if [ ! -f "$SITE/.complete" ]; then
  rm -rf "$SITE"; mkdir -p "$SITE"
  cat "$PARTS"/vllm-slim.tar.xz.part* | python3 -c "import sys,tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1], filter='fully_trusted')" "$SITE"
  python3 -c "import sys,tarfile; tarfile.open(sys.argv[2], mode='r:xz').extractall(sys.argv[1], filter='fully_trusted')" "$SITE" "$PARTS/deps-site.tar.xz"
  touch "$SITE/.complete"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
set +euo pipefail
