#!/bin/bash
# A/B of whole conversions between git revisions on one machine, alternating runs so drift in the
# machine's speed hits every revision alike; prints wall and CPU seconds per process and the I/O
# floor (scripts/bench_convert.py's) after each round.
#   scripts/bench_ab.sh SRC_CHECKPOINT WORK_DIR ROUNDS REV [REV...]
#   e.g. scripts/bench_ab.sh /tmp/b/synth8 /tmp/ab 2 1129bb1 HEAD
# Extra qconvert options through QC_ARGS (e.g. QC_ARGS=--no-source-checksums); schemes through SCHEMES.
set -euo pipefail
SRC=$1; W=$2; ROUNDS=$3; shift 3
ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
mkdir -p "$W"
for rev in "$@"; do
  rm -rf "$W/tree-$rev"; mkdir -p "$W/tree-$rev"
  git -C "$ROOT" archive "$rev" qconvert scripts | tar -x -C "$W/tree-$rev"
done
last=${@: -1}
for round in $(seq "$ROUNDS"); do for s in ${SCHEMES:-mxfp8 nvfp4}; do
  for rev in "$@"; do
    rm -rf "$W/out-$rev"
    ( cd "$W/tree-$rev" && PYTHONPATH=. /usr/bin/time -f "$round $s $rev wall %e s cpu %U+%S s" \
      python scripts/bench_convert.py _qconvert "$s" "$SRC" "$W/out-$rev" ${QC_ARGS:-} ) 2>&1 | tail -1
    sizes=$(python3 -c "import json,os,sys;d=sys.argv[1];print(json.dumps({f:os.path.getsize(os.path.join(d,f)) for f in os.listdir(d) if f.endswith('.safetensors')}))" "$W/out-$rev")
    # each output leaves the page cache before the next run: on a small machine a previous run's
    # output would otherwise push the next one into page reclaim (system time charged to it)
    rm -rf "$W/out-$rev"
  done
  rm -rf "$W/floor"
  ( cd "$W/tree-$last" && PYTHONPATH=. /usr/bin/time -f "$round $s floor wall %e s cpu %U+%S s" \
    python scripts/bench_convert.py _floor "$SRC" "$W/floor" "$sizes" ) 2>&1 | tail -1
  rm -rf "$W/floor"
done; done
