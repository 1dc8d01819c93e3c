#!/usr/bin/env bash
# Long single-sequence decode: one wave of long splits (planned) against 2-4 waves of shorter
# ones (--blocks-scale), and --min-chunk variants.
set -uo pipefail
source kernels/bench/lib.sh .stage "$OUT"
for r in 1 2; do
  for s in 1 2 3 4; do
    bench "bs${s}_r$r" "$b/pagedattn-bench" --cases "1,131072 4,32768 8,16384 1,65536 1,32768" --blocks-scale $s --reps 30 --no-read-roofline
  done
done
python3 kernels/bench/merge_rows.py "$tmp" "$OUT/waves.json" > /dev/null
python3 kernels/bench/rounds.py "$OUT/waves.json"
python3 -c "
import json
for r in json.load(open('$OUT/waves.json')):
  if r['variant'].endswith('_r1'): print(r['variant'], r['batch'], r['ctx'], 'blocks', r['blocks'], 'chunk', r['kv_chunk'], r['merge'])
"
