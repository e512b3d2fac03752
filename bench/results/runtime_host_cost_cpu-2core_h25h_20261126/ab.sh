#!/bin/bash
# A/B on one machine: base = main at 1ad0916 (git archive, with this branch's bench/runtime_host_cost.py
# copied in), after = branch h25h. Trees alternate; loads recorded before each run.
out=/tmp/h25h_final
for world in 1 2; do
  runs=3; [ $world = 2 ] && runs=2
  for i in $(seq 1 $runs); do
    order="/tmp/h25h_base /work/wt-h25h"; [ $((i % 2)) = 0 ] && order="/work/wt-h25h /tmp/h25h_base"
    for tree in $order; do
      tag=$([ $tree = /tmp/h25h_base ] && echo before || echo after)
      f=$out/w${world}_${tag}_$i
      echo "load $(cut -d' ' -f1-3 /proc/loadavg)" > $f.txt
      (cd $tree && PYTHONPATH=$tree timeout 600 /work/main/.venv/bin/python -m bench.runtime_host_cost --world $world \
        --rounds 4 --steps 20 --count-steps 1 --top 40 --json $f.json) >> $f.txt 2>&1
      echo "w$world $tag run $i: $(sed -n 1p $f.txt)"; sed -n '6,10p' $f.txt
    done
  done
done
