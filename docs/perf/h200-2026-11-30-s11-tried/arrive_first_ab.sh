#!/usr/bin/env bash
# Count-first in-kernel merge A/B: tests; old vs new, planned and in-kernel merges; timelines.
set -uo pipefail
source kernels/bench/lib.sh .stage "$OUT"
$b/kernel_tests --gtest_filter='CudaKernelTest.*:AttentionPlan.*' > "$out/kt.log" 2>&1
echo "kernel_tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$out/kt.log" | head -20
PAGEDATTN_PREFILL_KERNEL=portable $b/kernel_tests --gtest_filter='CudaKernelTest.*Prefill*:CudaKernelTest.Mixed*' > "$out/kt_portable.log" 2>&1
echo "kernel_tests portable rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$out/kt_portable.log" | head
cases="1,32768 16,4096 2,16384 4,32768"
for r in 1 2 3 4; do
  bench old_r$r $b/pagedattn-bench-old --cases "$cases" --no-read-roofline
  bench oldik_r$r $b/pagedattn-bench-old --cases "1,32768" --merge in-kernel --no-read-roofline
  bench new_r$r $b/pagedattn-bench --cases "$cases" --no-read-roofline
  bench newik_r$r $b/pagedattn-bench --cases "1,32768 2,16384 4,32768" --merge in-kernel --no-read-roofline
done
for r in 1 2; do
  for kv in 1 4; do
    bench kv${kv}_old_r$r $b/pagedattn-bench-old --kv-heads $kv --cases "1,32768 2,32768" --no-read-roofline --reps 30
    bench kv${kv}_new_r$r $b/pagedattn-bench --kv-heads $kv --cases "1,32768 2,32768" --no-read-roofline --reps 30
    bench kv${kv}_newik_r$r $b/pagedattn-bench --kv-heads $kv --cases "1,32768 2,32768" --merge in-kernel --no-read-roofline --reps 30
  done
  for d in 64 256; do
    bench d${d}_old_r$r $b/pagedattn-bench-old --head-dim $d --cases "1,32768 16,4096" --no-read-roofline --reps 30
    bench d${d}_new_r$r $b/pagedattn-bench --head-dim $d --cases "1,32768 16,4096" --no-read-roofline --reps 30
    bench d${d}_newik_r$r $b/pagedattn-bench --head-dim $d --cases "1,32768" --merge in-kernel --no-read-roofline --reps 30
  done
done
python3 kernels/bench/merge_rows.py "$tmp" "$out/ab.json" > /dev/null
$b/pagedattn-bench --cases "1,32768" --exp 32 --reps 20 --no-read-roofline --json "$out/tl_new.json" > "$out/tl_new.txt" 2>&1; echo "timeline new rc=$?"
$b/pagedattn-bench-old --cases "1,32768" --exp 32 --reps 20 --no-read-roofline --json "$out/tl_old.json" > "$out/tl_old.txt" 2>&1; echo "timeline old rc=$?"
python3 kernels/bench/rounds.py "$out/ab.json"
