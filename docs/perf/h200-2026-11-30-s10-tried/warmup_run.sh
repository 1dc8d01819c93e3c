#!/usr/bin/env bash
# Does a longer warm-up change the per-launch time? (clocks after sustained load)
set -uo pipefail
source kernels/bench/lib.sh .stage "$OUT"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks.max.sm,power.draw,pstate --format=csv,noheader
for r in 1 2 3; do
  bench "w10_r$r" "$b/pagedattn-bench" --cases "1,32768 16,4096" --no-read-roofline
  bench "w3000_r$r" "$b/pagedattn-bench" --cases "1,32768 16,4096" --warmup 3000 --no-read-roofline
  bench "r500_r$r" "$b/pagedattn-bench" --cases "1,32768 16,4096" --reps 500 --no-read-roofline
done
( for i in $(seq 1 20); do nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,pstate --format=csv,noheader; sleep 0.05; done ) > $OUT/clocks.txt &
"$b/pagedattn-bench" --cases "1,32768" --warmup 20000 --reps 2000 --no-read-roofline --json $tmp/long.json > /dev/null
wait
cat $OUT/clocks.txt | sort | uniq -c
python3 kernels/bench/merge_rows.py "$tmp" "$OUT/warm.json" > /dev/null
python3 - "$OUT/warm.json" <<'PY'
import json,sys,collections
rows=json.load(open(sys.argv[1]))
g=collections.defaultdict(list)
for r in rows:
  v=r['variant'].rsplit('_r',1)[0]
  g[(r['batch'],r['ctx'],v)].append((r['time_us'],r['b2b_time_us']))
for k in sorted(g):
  t=g[k]; print(k, ' '.join(f"{a:.2f}/{b:.2f}" for a,b in t))
PY
