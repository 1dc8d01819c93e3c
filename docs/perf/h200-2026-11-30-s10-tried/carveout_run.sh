#!/usr/bin/env bash
# A/B of the carveout preference (PAGEDATTN_EXP_CARVEOUT) in one binary, alternating rounds.
set -uo pipefail
source kernels/bench/lib.sh .stage "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
for r in 1 2 3; do
  bench "base_r$r" "$b/pagedattn-bench" --no-read-roofline
  PAGEDATTN_EXP_CARVEOUT=100 bench "c100_r$r" "$b/pagedattn-bench" --no-read-roofline
  bench "base_kv1_r$r" "$b/pagedattn-bench" --kv-heads 1 --cases "1,32768 1,131072" --no-read-roofline --reps 30
  PAGEDATTN_EXP_CARVEOUT=100 bench "c100_kv1_r$r" "$b/pagedattn-bench" --kv-heads 1 --cases "1,32768 1,131072" --no-read-roofline --reps 30
  bench "base_ik_r$r" "$b/pagedattn-bench" --cases "1,32768" --merge in-kernel --no-read-roofline
  PAGEDATTN_EXP_CARVEOUT=100 bench "c100_ik_r$r" "$b/pagedattn-bench" --cases "1,32768" --merge in-kernel --no-read-roofline
done
python3 kernels/bench/merge_rows.py "$tmp" "$OUT/ab.json"
python3 - "$OUT/ab.json" <<'PY'
import json,sys,collections
rows=json.load(open(sys.argv[1]))
g=collections.defaultdict(list)
for r in rows:
  v=r['variant'].rsplit('_r',1)[0]
  g[(r['batch'],r['ctx'],r['kv_heads'],r['merge'],v)].append((r['time_us'],r['b2b_time_us']))
for k in sorted(g):
  t=g[k]; print(k, ' '.join(f"{a:.1f}/{b:.1f}" for a,b in t))
PY
