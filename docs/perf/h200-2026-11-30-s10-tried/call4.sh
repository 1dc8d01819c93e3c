#!/usr/bin/env bash
set -uo pipefail
source kernels/bench/lib.sh .stage "$OUT"
.probe/hostprobe | tee "$OUT/hostprobe.txt"
for r in 1 2; do
  bench "base_r$r" "$b/pagedattn-bench" --cases "1,32768 16,4096" --no-read-roofline
  bench "s5h_r$r" "$b/pagedattn-bench" --cases "1,32768 16,4096" --stages 5 --blocks-scale 0.5 --no-read-roofline
  bench "s4h_r$r" "$b/pagedattn-bench" --cases "1,32768 16,4096" --stages 4 --blocks-scale 0.5 --no-read-roofline
done
python3 kernels/bench/merge_rows.py "$tmp" "$OUT/stages.json"
