#!/bin/bash
# slow_phase.py in fresh processes, alternating two trees; each process gets its own numba cache,
# emptied and primed by prime_parallel.py (so the parallel build of reorder_quantize is cached first).
# Usage: compare_slow_phase.sh ROUNDS BEFORE_TREE AFTER_TREE
set -e
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python}
for round in $(seq "$1"); do
  for tree in "$2" "$3"; do
    cache=$(mktemp -d)
    NUMBA_CACHE_DIR=$cache PYTHONPATH=$tree $py "$here/prime_parallel.py"
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    echo "round $round $(basename "$tree") load [$load] $(NUMBA_CACHE_DIR=$cache PYTHONPATH=$tree $py "$here/slow_phase.py")"
    rm -rf "$cache"
  done
done
