#!/usr/bin/env bash
# A/B of the per-warp copy pipeline (--exp 256) against the shipped decode tile, one binary.
set -uo pipefail
source kernels/bench/lib.sh .stage "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
for r in 1 2 3 4; do
  bench "base_r$r" "$b/pagedattn-bench" --no-read-roofline
  bench "e256_r$r" "$b/pagedattn-bench" --exp 256 --no-read-roofline
done
for e in 0 256; do
  bench "kv1_e$e" "$b/pagedattn-bench" --exp $e --kv-heads 1 --cases "1,32768 8,4096 1,131072" --no-read-roofline --reps 30
  bench "kv2_e$e" "$b/pagedattn-bench" --exp $e --kv-heads 2 --cases "1,32768 2,16384" --no-read-roofline --reps 30
  bench "mha_e$e" "$b/pagedattn-bench" --exp $e --kv-heads 32 --cases "8,8192 64,2048" --no-read-roofline --reps 30
  bench "q64_e$e" "$b/pagedattn-bench" --exp $e --q-heads 64 --cases "1,32768 32,4096" --no-read-roofline --reps 30
  bench "p1_e$e" "$b/pagedattn-bench" --exp $e --page-size 1 --cases "1,32768 16,4096" --no-read-roofline --reps 30
  bench "p128_e$e" "$b/pagedattn-bench" --exp $e --page-size 128 --cases "1,32768 16,4096" --no-read-roofline --reps 30
  bench "p3_e$e" "$b/pagedattn-bench" --exp $e --page-size 3 --cases "1,5000 3,777" --no-read-roofline --reps 10
  bench "rag_e$e" "$b/pagedattn-bench" --exp $e --ragged 4096,100,7000,1,33,12000 --no-read-roofline --reps 20
done
python3 kernels/bench/merge_rows.py "$tmp" "$OUT/ab.json" > "$OUT/rows.txt"
for e in 32 288; do
  "$b/pagedattn-bench" --cases "1,32768" --exp $e --merge in-kernel --reps 20 --no-read-roofline \
    --json "$OUT/timeline_$e.json" > "$OUT/timeline_$e.txt" 2>&1; echo "timeline $e rc=$?"
done
python3 - "$OUT/ab.json" <<'PY'
import json,sys,collections
rows=json.load(open(sys.argv[1]))
g=collections.defaultdict(list)
for r in rows:
  v=r['variant'].rsplit('_r',1)[0]
  g[(r['page_size'],r['q_heads'],r['kv_heads'],r['batch'],r['ctx'],v)].append((r['time_us'],r['b2b_time_us'],r['max_rel_err']))
for k in sorted(g):
  t=g[k]; print(k, ' '.join(f"{a:.1f}/{b:.1f}" for a,b,e in t), 'err', max(e for a,b,e in t))
PY
grep -A12 "launch 2" "$OUT/timeline_32.txt" | head -14; grep -A12 "launch 2" "$OUT/timeline_288.txt" | head -14
