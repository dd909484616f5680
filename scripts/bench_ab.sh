#!/bin/bash
# A/B of whole conversions between git revisions on one machine, alternating runs so drift in the
# machine's speed hits every revision alike; prints wall and CPU seconds per process and the I/O
# floor (scripts/bench_convert.py's) after each round.
#   scripts/bench_ab.sh SRC_CHECKPOINT WORK_DIR ROUNDS REV [REV...]
#   e.g. scripts/bench_ab.sh /tmp/b/synth8 /tmp/ab 2 1129bb1 HEAD
# A REV that is a directory is taken as an unpacked tree (holding qconvert/ and scripts/), for
# machines without the git history. Each run also prints the sha256 of its output shards, so a
# change that alters bytes shows.
# Extra qconvert options through QC_ARGS (e.g. QC_ARGS=--no-source-checksums); schemes through SCHEMES.
set -euo pipefail
SRC=$1; W=$2; ROUNDS=$3; shift 3
mkdir -p "$W"
W=$(cd "$W" && pwd)
declare -A TREE NAME
i=0
for rev in "$@"; do
  i=$((i + 1))
  if [ -d "$rev" ]; then
    TREE[$i]=$(cd "$rev" && pwd); NAME[$i]=$(basename "${TREE[$i]}")
  else
    ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
    TREE[$i]="$W/tree-$rev"; NAME[$i]=$rev
    rm -rf "${TREE[$i]}"; mkdir -p "${TREE[$i]}"
    git -C "$ROOT" archive "$rev" qconvert scripts | tar -x -C "${TREE[$i]}"
  fi
done
for round in $(seq "$ROUNDS"); do for s in ${SCHEMES:-mxfp8 nvfp4}; do
  for k in $(seq "$i"); do
    out="$W/out-$k"
    rm -rf "$out"
    ( cd "${TREE[$k]}" && PYTHONPATH=. /usr/bin/time -f "$round $s ${NAME[$k]} wall %e s cpu %U+%S s" \
      python scripts/bench_convert.py _qconvert "$s" "$SRC" "$out" ${QC_ARGS:-} ) 2>&1 | tail -1
    echo "  output bytes $(cd "$out" && cat $(ls *.safetensors | sort) | sha256sum | cut -c1-16)"
    sizes=$(python3 -c "import json,os,sys;d=sys.argv[1];print(json.dumps({f:os.path.getsize(os.path.join(d,f)) for f in os.listdir(d) if f.endswith('.safetensors')}))" "$out")
    # each output leaves the page cache before the next run: on a small machine a previous run's
    # output would otherwise push the next one into page reclaim (system time charged to it)
    rm -rf "$out"
  done
  rm -rf "$W/floor"
  ( cd "${TREE[$i]}" && PYTHONPATH=. /usr/bin/time -f "$round $s floor wall %e s cpu %U+%S s" \
    python scripts/bench_convert.py _floor "$SRC" "$W/floor" "$sizes" ) 2>&1 | tail -1
  rm -rf "$W/floor"
done; done
