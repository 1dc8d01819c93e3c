#!/usr/bin/env bash
# Pool A/B 3 (pools at head_dim 128 only, no-pool kernels as at HEAD): tests, rounds, timelines.
set -uo pipefail
source kernels/bench/lib.sh .stage "$OUT"
$b/kernel_tests --gtest_filter='CudaKernelTest.*:AttentionPlan.*' > "$out/kt.log" 2>&1
echo "kernel_tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$out/kt.log" | head -20
cases="1,32768 16,4096 64,4096 256,2048 128,8192 2,16384 4,32768 1,131072"
for r in 1 2 3; do
  bench old_r$r $b/pagedattn-bench-old --cases "$cases" --no-read-roofline
  bench new_r$r $b/pagedattn-bench --cases "$cases" --no-read-roofline
  bench p0_r$r $b/pagedattn-bench --cases "$cases" --pool 0 --no-read-roofline
  bench newik_r$r $b/pagedattn-bench --cases "1,32768 2,16384" --merge in-kernel --no-read-roofline
done
for r in 1 2; do
  for d in 64 256; do
    bench d${d}_old_r$r $b/pagedattn-bench-old --head-dim $d --cases "1,32768 16,4096" --no-read-roofline --reps 30
    bench d${d}_new_r$r $b/pagedattn-bench --head-dim $d --cases "1,32768 16,4096" --no-read-roofline --reps 30
  done
  for kv in 1 2 4; do
    bench kv${kv}_old_r$r $b/pagedattn-bench-old --kv-heads $kv --cases "1,32768 2,32768" --no-read-roofline --reps 30
    bench kv${kv}_new_r$r $b/pagedattn-bench --kv-heads $kv --cases "1,32768 2,32768" --no-read-roofline --reps 30
  done
done
python3 kernels/bench/merge_rows.py "$tmp" "$out/ab.json" > /dev/null
for pool in 0 15; do
  $b/pagedattn-bench --cases "1,32768" --exp 32 --pool $pool --reps 20 --no-read-roofline \
    --json "$out/tl_p$pool.json" > "$out/tl_p$pool.txt" 2>&1; echo "timeline p$pool rc=$?"
done
python3 kernels/bench/rounds.py "$out/ab.json"
