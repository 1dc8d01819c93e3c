#!/usr/bin/env bash
# A/B of the L2 prefetch variants (--exp 64/128/192: 1/2/3 tiles beyond the copies) against the
# shipped kernel, one binary, alternating rounds.
set -uo pipefail
source kernels/bench/lib.sh .stage "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
for r in 1 2 3; do
  bench "base_r$r" "$b/pagedattn-bench" --no-read-roofline
  for e in 64 128 192; do bench "e${e}_r$r" "$b/pagedattn-bench" --exp $e --no-read-roofline; done
done
for e in 0 64 128 192; do
  bench "kv1_e$e" "$b/pagedattn-bench" --exp $e --kv-heads 1 --cases "1,32768 8,4096 1,131072" --no-read-roofline --reps 30
  bench "mha_e$e" "$b/pagedattn-bench" --exp $e --kv-heads 32 --cases "8,8192 64,2048" --no-read-roofline --reps 30
  bench "p1_e$e" "$b/pagedattn-bench" --exp $e --page-size 1 --cases "1,32768 16,4096" --no-read-roofline --reps 30
  bench "p128_e$e" "$b/pagedattn-bench" --exp $e --page-size 128 --cases "1,32768 16,4096" --no-read-roofline --reps 30
  bench "p3_e$e" "$b/pagedattn-bench" --exp $e --page-size 3 --cases "1,5000 3,777" --no-read-roofline --reps 10
done
python3 kernels/bench/merge_rows.py "$tmp" "$OUT/ab.json" > "$OUT/rows.txt"
grep -c . "$OUT/rows.txt"
python3 - "$OUT/ab.json" <<'PY'
import json,sys,collections
rows=json.load(open(sys.argv[1]))
g=collections.defaultdict(list)
for r in rows:
  v=r['variant'].rsplit('_r',1)[0]
  g[(r['page_size'],r['kv_heads'],r['batch'],r['ctx'],v)].append((r['time_us'],r['b2b_time_us'],r['max_rel_err']))
for k in sorted(g):
  t=g[k]; print(k, ' '.join(f"{a:.1f}/{b:.1f}" for a,b,e in t), 'err', max(e for a,b,e in t))
PY
