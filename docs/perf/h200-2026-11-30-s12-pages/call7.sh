#!/usr/bin/env bash
# Call 7: three builds of the carried first pages against HEAD (old): A (call 6's), B (A + the
# item index by a FastDivmod, no integer division before the item load), C (B + each prologue
# tile's addresses computed after the tile before it is issued). Five rounds, interleaved.
set -uo pipefail
export BENCH_TIMEOUT=90
source kernels/bench/lib.sh .stage "$OUT"
cases="1,32768 16,4096 2,16384"
for r in 1 2 3 4 5; do
  for v in old A B C; do
    bench ${v}_r$r $b/pagedattn-bench-$v --cases "$cases" --reps 200 --no-read-roofline
  done
done
for v in old A B C; do
  bench kv1_${v} $b/pagedattn-bench-$v --kv-heads 1 --cases "1,32768 1,131072" --no-read-roofline --reps 100
  bench d64_${v} $b/pagedattn-bench-$v --head-dim 64 --cases "1,32768 16,4096" --no-read-roofline --reps 100
done
python3 kernels/bench/merge_rows.py "$tmp" "$out/ab.json" > /dev/null
$b/pagedattn-bench-C --cases "1,32768" --exp 32 --reps 20 --no-read-roofline \
  --json "$out/tl.json" > "$out/tl.txt" 2>&1; echo "timeline rc=$?"
python3 kernels/bench/rounds.py "$out/ab.json"
