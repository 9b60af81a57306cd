#!/usr/bin/env bash
# Two checkouts side by side on one machine, alternately: `bench/ab.sh BASE OUT RUNS SCRIPT [ARGS...]` runs
# `bench/SCRIPT ARGS... --json OUT/<side><k>.json` for k = 1..RUNS, first with the checkout at BASE (a folder holding
# its hypic_jax/, converters/ and bench/), then with this one; sides "base" and "head". The same script name
# runs in each checkout, so each side takes its own version of the benchmark's arguments.
set -euo pipefail
base=$(cd "$1" && pwd); out=$2; runs=$3; script=$4; shift 4
head=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
for k in $(seq 1 "$runs"); do
  for side in base head; do
    root=$([ "$side" = base ] && echo "$base" || echo "$head")
    echo "== $side run $k: $script $*" >&2
    (cd "$root" && PYTHONPATH="$root" python "bench/$script" "$@" --json "$out/$side$k.json")
  done
done
