#!/usr/bin/env bash
# One GPU lease, one command: `bench/gpu_lease.sh OUTDIR` runs gpu-check and then gpu-bench
# (`python -m bench.gpu_check [--bench]`) from the checkout this script sits in, with GPU_PYTHON
# (default python3), each under a hard `timeout` a little above its own deadline; then packs
# each result folder into OUTDIR as a tarball beside the two report.md files and its log (5
# files). Exit status: gpu-check's if that failed, else gpu-bench's. It installs nothing.
# Limits and what each part runs: docs/gpu-check.md.
set -u
if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 64
fi
out=$(mkdir -p "$1" && cd "$1" && pwd) || exit 64
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${GPU_PYTHON:-python3}
stamp=$(date -u +%Y%m%d-%H%M%S)
check=$repo/bench/results/gpu-check_lease_$stamp
bench=$repo/bench/results/gpu-bench_lease_$stamp
log=$out/gpu-lease.log
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
cd "$repo" || exit 64

run() {  # NAME LIMIT_S FOLDER [FLAG]: one command under a hard limit, its output in the lease log
  local name=$1 limit=$2 folder=$3 start=$SECONDS status
  echo "== $name (hard limit ${limit} s), $(date -u +%H:%M:%S) UTC" >>"$log"
  timeout -k 15 "$limit" "$python" -m bench.gpu_check ${4:-} --out "$folder" >>"$log" 2>&1
  status=$?
  echo "== $name: exit $status after $((SECONDS - start)) s" >>"$log"
  return $status
}

: >"$log"
run gpu-check 485 "$check"; check_status=$?
run gpu-bench 255 "$bench" --bench; bench_status=$?
for folder in "$check" "$bench"; do
  name=$(basename "$folder")
  if [ -d "$folder" ]; then
    tar -czf "$out/${name%%_lease_*}.tar.gz" -C "$(dirname "$folder")" "$name"
    [ -f "$folder/report.md" ] && cp "$folder/report.md" "$out/${name%%_lease_*}-report.md"
  else
    echo "== $name: no result folder was written" >>"$log"
  fi
done
echo "gpu-check exit $check_status, gpu-bench exit $bench_status; files in $out" | tee -a "$log"
if [ "$check_status" -ne 0 ]; then exit "$check_status"; fi
exit "$bench_status"
