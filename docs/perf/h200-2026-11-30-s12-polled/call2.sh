#!/usr/bin/env bash
# Call 2: the separate merge reading its task before the grid wait (new) against HEAD (old),
# and the start's probes in the timeline build (slots 12-14: item, first page ids, first copies).
set -uo pipefail
export BENCH_TIMEOUT=90
source kernels/bench/lib.sh .stage "$OUT"
$b/kernel_tests --gtest_filter='CudaKernelTest.*:AttentionPlan.*' > "$out/kt.log" 2>&1
echo "kernel_tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$out/kt.log" | head
for r in 1 2 3 4; do
  bench old_r$r $b/pagedattn-bench-old --cases "1,32768 2,16384" --reps 300 --no-read-roofline
  bench new_r$r $b/pagedattn-bench --cases "1,32768 2,16384" --reps 300 --no-read-roofline
  bench kv4_old_r$r $b/pagedattn-bench-old --kv-heads 4 --cases "1,32768 2,16384" --reps 100 --no-read-roofline
  bench kv4_new_r$r $b/pagedattn-bench --kv-heads 4 --cases "1,32768 2,16384" --reps 100 --no-read-roofline
  bench kv1_old_r$r $b/pagedattn-bench-old --kv-heads 1 --cases "1,131072 1,32768" --reps 100 --no-read-roofline
  bench kv1_new_r$r $b/pagedattn-bench --kv-heads 1 --cases "1,131072 1,32768" --reps 100 --no-read-roofline
done
python3 kernels/bench/merge_rows.py "$tmp" "$out/ab.json" > /dev/null
for i in 1 2; do
  $b/pagedattn-bench --cases "1,32768" --exp 32 --reps 20 --no-read-roofline \
    --json "$out/tl$i.json" > "$out/tl$i.txt" 2>&1; echo "timeline $i rc=$?"
done
python3 kernels/bench/rounds.py "$out/ab.json"
