#!/usr/bin/env bash
# Call 4: where call 3's slowdown comes from. old = HEAD; mtw = HEAD + the merge task read before
# the grid wait; new = this build (first pages carried when the prologue's pages fit, the 16-row
# head_dim-128 tile at __maxnreg__(192)); nomax = new without __maxnreg__; noattach = new,
# --first-pages off. Rounds interleaved; then tests and a timeline of new.
set -uo pipefail
export BENCH_TIMEOUT=90
source kernels/bench/lib.sh .stage "$OUT"
cases="1,32768 16,4096 2,16384"
for r in 1 2 3 4; do
  bench old_r$r $b/pagedattn-bench-old --cases "$cases" --reps 200 --no-read-roofline
  bench mtw_r$r $b/pagedattn-bench-mtw --cases "$cases" --reps 200 --no-read-roofline
  bench new_r$r $b/pagedattn-bench --cases "$cases" --reps 200 --no-read-roofline
  bench nomax_r$r $b/pagedattn-bench-nomax --cases "$cases" --reps 200 --no-read-roofline
  bench noattach_r$r $b/pagedattn-bench --first-pages off --cases "$cases" --reps 200 --no-read-roofline
done
for r in 1 2; do
  for v in old new; do
    bin=$b/pagedattn-bench; [ $v = old ] && bin=$b/pagedattn-bench-old
    bench d64_${v}_r$r $bin --head-dim 64 --cases "1,32768 16,4096" --no-read-roofline --reps 50
    bench pg1_${v}_r$r $bin --page-size 1 --cases "1,32768 16,4096" --no-read-roofline --reps 30
  done
done
python3 kernels/bench/merge_rows.py "$tmp" "$out/ab.json" > /dev/null
$b/kernel_tests > "$out/kt.log" 2>&1
echo "kernel_tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$out/kt.log" | head
$b/pagedattn-bench --cases "1,32768" --exp 32 --reps 20 --no-read-roofline \
  --json "$out/tl.json" > "$out/tl.txt" 2>&1; echo "timeline rc=$?"
python3 kernels/bench/rounds.py "$out/ab.json"
