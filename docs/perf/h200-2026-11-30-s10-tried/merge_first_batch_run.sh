#!/usr/bin/env bash
# Separate merge variant 1 (task read before the grid wait; each warp's first 5 splits loaded
# at once) against the shipped merge: --exp 16384 runs the shipped tiles with it.
set -uo pipefail
source kernels/bench/lib.sh .stage "$OUT"
for r in 1 2 3 4; do
  for e in 0 16384; do
    bench "e${e}_kv8_r$r" "$b/pagedattn-bench" --exp $e --cases "1,32768 2,32768" --reps 100 --no-read-roofline
    bench "e${e}_kv1_r$r" "$b/pagedattn-bench" --exp $e --kv-heads 1 --cases "1,32768 1,131072" --reps 100 --no-read-roofline
    bench "e${e}_kv4_r$r" "$b/pagedattn-bench" --exp $e --kv-heads 4 --cases "1,32768 2,16384" --reps 100 --no-read-roofline
  done
done
python3 kernels/bench/merge_rows.py "$tmp" "$OUT/ab.json" > /dev/null
python3 kernels/bench/rounds.py "$OUT/ab.json"
