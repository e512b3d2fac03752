#!/usr/bin/env bash
# One GPU lease, one command: `bench/gpu_lease.sh OUTDIR` runs gpu-check, then gpu-bench, each under a
# hard `timeout` a little above its own deadline, with GPU_PYTHON (default python3), and leaves in
# OUTDIR each result folder as a tarball, the two report.md files and the log (docs/gpu-check.md).
set -u
[ $# -eq 1 ] || { echo "usage: $0 OUTDIR" >&2; exit 64; }
out=$(mkdir -p "$1" && cd "$1" && pwd) || exit 64
repo=$(cd "$(dirname "$0")/.." && pwd)
stamp=$(date -u +%Y%m%d-%H%M%S)
log=$out/gpu-lease.log
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
cd "$repo" || exit 64
: >"$log"

run() {  # NAME LIMIT_S [FLAG]: one part under a hard limit, its output in the lease log, its results packed
  local name=$1 limit=$2 folder=$repo/bench/results/$1_lease_$stamp start=$SECONDS status
  echo "== $name (hard limit ${limit} s), $(date -u +%H:%M:%S) UTC" >>"$log"
  timeout -k 15 "$limit" "${GPU_PYTHON:-python3}" -m bench.gpu_check ${3:-} --out "$folder" >>"$log" 2>&1
  status=$?
  echo "== $name: exit $status after $((SECONDS - start)) s" >>"$log"
  if [ -d "$folder" ]; then
    tar -czf "$out/$name.tar.gz" -C "$(dirname "$folder")" "$(basename "$folder")"
    [ -f "$folder/report.md" ] && cp "$folder/report.md" "$out/$name-report.md"
  else
    echo "== $name: no result folder was written" >>"$log"
  fi
  return $status
}

run gpu-check 485; check_status=$?
run gpu-bench 255 --bench; bench_status=$?
echo "gpu-check exit $check_status, gpu-bench exit $bench_status; files in $out" | tee -a "$log"
[ "$check_status" -ne 0 ] && exit "$check_status"
exit "$bench_status"
