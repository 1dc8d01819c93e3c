#!/usr/bin/env bash
# Does a later start move the end? Blocks spin 0.5 / 1 / 2 us at entry (--exp 512/1024/2048).
set -uo pipefail
source kernels/bench/lib.sh .stage "$OUT"
for r in 1 2 3; do
  for e in 0 512 1024 2048; do
    bench "e${e}_r$r" "$b/pagedattn-bench" --exp $e --cases "1,32768 16,4096 64,4096" --no-read-roofline
  done
done
python3 kernels/bench/merge_rows.py "$tmp" "$OUT/delay.json" > /dev/null
python3 - "$OUT/delay.json" <<'PY'
import json,sys,collections
rows=json.load(open(sys.argv[1]))
g=collections.defaultdict(list)
for r in rows:
  v=r['variant'].rsplit('_r',1)[0]
  g[(r['batch'],r['ctx'],v)].append((r['time_us'],r['b2b_time_us']))
for k in sorted(g):
  t=g[k]; print(k, ' '.join(f"{a:.1f}/{b:.2f}" for a,b in t))
PY
