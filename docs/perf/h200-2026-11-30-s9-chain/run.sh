#!/bin/bash
# call 2: decode softmax chain cuts. new = two S chains + ex2.approx + thread-local raise test,
# ab = without the thread-local test, old = HEAD.
set -u
S=.stage; O=$1
source $S/env.sh
timeout 200 $S/bin/kernel_tests > $O/kernel_tests.txt 2>&1; echo "kernel_tests rc=$?"; tail -2 $O/kernel_tests.txt
T=/tmp/r2; mkdir -p $T
b() { local n=$1 bin=$2; shift 2; timeout 150 $bin "$@" --no-read-roofline --json $T/$n.json > /dev/null 2>&1 || echo "bench $n failed"; }
for r in 1 2 3; do
  b new_r$r $S/bin/pagedattn-bench
  b ab_r$r $S/bin/pagedattn-bench-ab
  b old_r$r $S/bin/pagedattn-bench-old
done
for v in new ab old; do
  bin=$S/bin/pagedattn-bench; [ $v = ab ] && bin=$S/bin/pagedattn-bench-ab; [ $v = old ] && bin=$S/bin/pagedattn-bench-old
  b ${v}_d64 $bin --head-dim 64 --reps 30
  b ${v}_d256 $bin --head-dim 256 --reps 30
  b ${v}_kv1 $bin --kv-heads 1 --cases "1,32768 8,4096 1,131072" --reps 30
  b ${v}_mha $bin --kv-heads 32 --cases "64,2048 8,8192" --reps 30
  b ${v}_f16 $bin --dtype float16 --cases "1,32768 64,4096" --reps 30
done
python3 kernels/bench/merge_rows.py $T $O/ab.json > /dev/null
$S/bin/pagedattn-bench --cases "1,32768" --exp 32 --reps 20 --no-read-roofline --json $O/timeline.json > $O/timeline.txt 2>&1; echo "timeline rc=$?"
timeout 200 python3 $S/peers.py --prefill none --no-limits --out $O/peers.json > $O/peers.log 2>&1; echo "peers rc=$?"
timeout 200 python3 $S/peers.py --prefill none --no-limits --kv-heads 32 --decode "64,2048 8,8192" --out $O/peers_mha.json > $O/peers_mha.log 2>&1; echo "peers mha rc=$?"
