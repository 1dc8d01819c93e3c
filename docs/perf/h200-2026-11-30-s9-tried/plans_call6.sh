#!/bin/bash
# call 6: 1 x 32768 plan variants on the item-major grid: merge kind, 256 vs 264 blocks
S=.stage; O=$1
mkdir -p .stage && tar xJf .stage-pack/stage.tar.xz -C .stage
source $S/env.sh
T=/tmp/r6; mkdir -p $T
b() { local n=$1; shift; timeout 100 $S/bin/pagedattn-bench "$@" --no-read-roofline --json $T/$n.json > /dev/null 2>&1 || echo "bench $n failed"; }
for r in 1 2 3; do
  b planned_r$r --cases "1,32768 16,4096"
  b inkernel_r$r --cases "1,32768 16,4096" --merge in-kernel
  b separate_r$r --cases "1,32768 16,4096" --merge separate
  b b256_r$r --cases "1,32768" --blocks-scale 0.97
  b b256inkernel_r$r --cases "1,32768" --blocks-scale 0.97 --merge in-kernel
  b kv1planned_r$r --kv-heads 1 --cases "1,32768 1,131072" --reps 30
  b kv1inkernel_r$r --kv-heads 1 --cases "1,32768 1,131072" --reps 30 --merge in-kernel
done
python3 kernels/bench/merge_rows.py $T $O/plans.json > /dev/null
