#!/usr/bin/env bash
# Thirteenth session, call 2: the graph launcher's three per-launch calls through the driver's
# entry points (new) against HEAD b2b5f69's runtime calls (old), alternating processes; the
# kernel tests on new; --exp 32's launch-path lines (host time of one launch) on both.
set -uo pipefail
export BENCH_TIMEOUT=90
source kernels/bench/lib.sh .stage "$OUT"
$b/kernel_tests > "$out/kt.log" 2>&1; echo "kernel_tests rc=$?"
grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$out/kt.log" | head
for r in 1 2 3 4 5 6 7; do
  bench old_r$r $b/pagedattn-bench-old --cases "1,32768 16,4096" --reps 200 --no-read-roofline
  bench new_r$r $b/pagedattn-bench --cases "1,32768 16,4096" --reps 200 --no-read-roofline
done
python3 kernels/bench/merge_rows.py "$tmp" "$out/ab.json" > /dev/null
python3 kernels/bench/rounds.py "$out/ab.json"
for r in 1 2; do
  for v in old new; do
    bin=$b/pagedattn-bench; [ $v = old ] && bin=$b/pagedattn-bench-old
    $bin --cases "1,32768" --exp 32 --reps 20 --no-read-roofline --json /dev/null > "$out/floor_${v}_$r.txt" 2>&1
    echo "$v: $(grep -h -o '"host_launch_us[^}]*' "$out/floor_${v}_$r.txt")"
  done
done
