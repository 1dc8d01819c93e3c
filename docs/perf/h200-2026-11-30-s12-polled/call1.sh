#!/usr/bin/env bash
# Polled separate merge A/B 1: HEAD's bench (old, planned) against this build's separate merge
# waiting for the grid (sep), polling with an LSE gate (p1) and polling whole rows (p2).
set -uo pipefail
export BENCH_TIMEOUT=60
source kernels/bench/lib.sh .stage "$OUT"
for r in 1 2 3 4; do
  bench old_r$r $b/pagedattn-bench-old --cases "1,32768" --reps 300 --no-read-roofline
  bench sep_r$r $b/pagedattn-bench --merge separate --cases "1,32768" --reps 300 --no-read-roofline
  bench p1_r$r $b/pagedattn-bench --merge polled1 --cases "1,32768" --reps 300 --no-read-roofline
  bench p2_r$r $b/pagedattn-bench --merge polled2 --cases "1,32768" --reps 300 --no-read-roofline
done
for r in 1 2; do
  for v in old:planned sep:separate p1:polled1 p2:polled2; do
    n=${v%%:*}; m=${v#*:}; bin=$b/pagedattn-bench; [ $n = old ] && bin=$b/pagedattn-bench-old && m=planned
    bench kv1_${n}_r$r $bin --merge $m --kv-heads 1 --cases "1,32768 8,4096 1,131072" --no-read-roofline --reps 50
    bench kv2_${n}_r$r $bin --merge $m --kv-heads 2 --cases "1,32768 2,16384" --no-read-roofline --reps 50
    bench d64_${n}_r$r $bin --merge $m --head-dim 64 --cases "1,32768 2,16384" --no-read-roofline --reps 50
    bench d256_${n}_r$r $bin --merge $m --head-dim 256 --cases "1,32768 2,16384" --no-read-roofline --reps 50
    bench p1pg_${n}_r$r $bin --merge $m --page-size 1 --cases "1,32768" --no-read-roofline --reps 30
  done
done
python3 kernels/bench/merge_rows.py "$tmp" "$out/ab.json" > /dev/null
python3 kernels/bench/rounds.py "$out/ab.json"
