#!/usr/bin/env bash
# Thirteenth session, call 6: head_dim 64 decode with 3 pipeline stages (4 blocks an SM; new)
# against the shipped 4 (3 blocks; old = HEAD's kernels), alternating processes, three rounds: the
# five default shapes, 1 and 2 kv heads (the separate merge), MHA, page 1, float16; the kernel
# tests on new first.
set -uo pipefail
export BENCH_TIMEOUT=120
source kernels/bench/lib.sh .stage "$OUT"
$b/kernel_tests > "$out/kt.log" 2>&1; echo "kernel_tests rc=$?"
grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$out/kt.log" | head
for r in 1 2 3; do
  for v in old new; do
    bin=$b/pagedattn-bench; [ $v = old ] && bin=$b/pagedattn-bench-old
    bench def_${v}_r$r $bin --head-dim 64 --no-read-roofline
    bench kv1_${v}_r$r $bin --head-dim 64 --kv-heads 1 --cases "1,32768 8,4096 1,131072" --no-read-roofline
    bench kv2_${v}_r$r $bin --head-dim 64 --kv-heads 2 --cases "1,32768 2,16384" --no-read-roofline
    bench mha_${v}_r$r $bin --head-dim 64 --q-heads 32 --kv-heads 32 --cases "1,32768 16,4096 64,2048" --no-read-roofline
    bench p1_${v}_r$r $bin --head-dim 64 --page-size 1 --cases "1,32768 16,4096" --no-read-roofline --reps 30
    bench f16_${v}_r$r $bin --head-dim 64 --dtype float16 --cases "1,32768 256,2048" --no-read-roofline
  done
done
python3 kernels/bench/merge_rows.py "$tmp" "$out/ab.json" > /dev/null
python3 kernels/bench/rounds.py "$out/ab.json"
