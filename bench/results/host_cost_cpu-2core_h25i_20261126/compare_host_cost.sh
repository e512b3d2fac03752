#!/bin/bash
# python -m bench.host_cost --device cpu --sizes 1K,64K, alternating two trees, each run with its own
# numba cache emptied and primed by prime_parallel.py; output to host_cost_<tree>_<round>.txt here.
# Usage: compare_host_cost.sh ROUNDS BEFORE_TREE AFTER_TREE
set -e
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python}
for round in $(seq "${FIRST:-1}" "$1"); do
  for tree in "$2" "$3"; do
    cache=$(mktemp -d)
    NUMBA_CACHE_DIR=$cache PYTHONPATH=$tree $py "$here/prime_parallel.py"
    out="$here/host_cost_$(basename "$tree")_$round.txt"
    echo "load at start: $(cat /proc/loadavg)" > "$out"
    (cd "$tree" && NUMBA_CACHE_DIR=$cache $py -m bench.host_cost --device cpu --sizes 1K,64K) >> "$out" 2>&1
    echo "load at end: $(cat /proc/loadavg)" >> "$out"
    rm -rf "$cache"
  done
done
