#!/usr/bin/env bash
# Call 5: the bench now uploads the decode items and their first pages in one buffer (as the
# server's workspace does); timeline probe slot 15 (the first pages arrived). old = HEAD.
set -uo pipefail
export BENCH_TIMEOUT=90
source kernels/bench/lib.sh .stage "$OUT"
for r in 1 2 3 4; do
  bench old_r$r $b/pagedattn-bench-old --cases "1,32768 16,4096" --reps 200 --no-read-roofline
  bench new_r$r $b/pagedattn-bench --cases "1,32768 16,4096" --reps 200 --no-read-roofline
  bench noattach_r$r $b/pagedattn-bench --first-pages off --cases "1,32768 16,4096" --reps 200 --no-read-roofline
done
python3 kernels/bench/merge_rows.py "$tmp" "$out/ab.json" > /dev/null
for i in 1 2; do
  $b/pagedattn-bench --cases "1,32768" --exp 32 --reps 20 --no-read-roofline \
    --json "$out/tl$i.json" > "$out/tl$i.txt" 2>&1; echo "timeline rc=$?"
done
$b/pagedattn-bench --cases "1,32768" --exp 32 --first-pages off --reps 20 --no-read-roofline \
  --json "$out/tl_off.json" > "$out/tl_off.txt" 2>&1; echo "timeline off rc=$?"
python3 kernels/bench/rounds.py "$out/ab.json"
