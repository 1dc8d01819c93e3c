#!/usr/bin/env bash
# Page ids loaded with an L2 evict_last policy (--exp 8192) against the shipped kernel.
set -uo pipefail
source kernels/bench/lib.sh .stage "$OUT"
for r in 1 2 3; do
  bench "base_r$r" "$b/pagedattn-bench" --no-read-roofline
  bench "keep_r$r" "$b/pagedattn-bench" --exp 8192 --no-read-roofline
done
for e in 0 8192; do
  bench "kv1_e$e" "$b/pagedattn-bench" --exp $e --kv-heads 1 --cases "1,32768 8,4096 1,131072" --no-read-roofline --reps 30
  bench "mha_e$e" "$b/pagedattn-bench" --exp $e --kv-heads 32 --cases "8,8192 64,2048" --no-read-roofline --reps 30
  bench "p1_e$e" "$b/pagedattn-bench" --exp $e --page-size 1 --cases "1,32768 16,4096" --no-read-roofline --reps 30
  bench "p128_e$e" "$b/pagedattn-bench" --exp $e --page-size 128 --cases "1,32768 16,4096" --no-read-roofline --reps 30
done
python3 kernels/bench/merge_rows.py "$tmp" "$OUT/ab.json" > /dev/null
python3 - "$OUT/ab.json" <<'PY'
import json,sys,collections
rows=json.load(open(sys.argv[1]))
g=collections.defaultdict(list)
for r in rows:
  v=r['variant'].rsplit('_r',1)[0]
  g[(r['page_size'],r['kv_heads'],r['batch'],r['ctx'],v)].append((r['time_us'],r['b2b_time_us'],r['max_rel_err']))
for k in sorted(g):
  t=g[k]; print(k, ' '.join(f"{a:.1f}/{b:.2f}" for a,b,e in t), 'err %.2g' % max(e for a,b,e in t))
PY
for e in 32 8224; do
"$b/pagedattn-bench" --cases "1,32768" --exp $e --reps 20 --no-read-roofline --json $OUT/tl$e.json > $OUT/tl$e.txt 2>&1
python3 - $OUT/tl$e.json.case0.csv $e <<'PY'
import csv,sys
rows=list(csv.DictReader(open(sys.argv[1])))
def q(col):
  v=sorted(int(r[col])/1000 for r in rows if int(r[col])>=0)
  return [round(v[int(f*(len(v)-1))],2) for f in (0,.25,.5,.75,1)]
print(sys.argv[2], ' '.join(f"{c}={q(c)}" for c in ['params','item_or_lse_max','issued','tiles_done','end']))
PY
grep -o '"event_us": [0-9.]*' $OUT/tl$e.txt | tr '\n' ' '; echo
done
