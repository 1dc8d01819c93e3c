#!/usr/bin/env bash
# Thirteenth session, call 7: call 6's head_dim 64 regressions (1 kv head 1 x 131072, 1 x 32768
# on 8 kv heads) under the 3-stage tile: the planner's target of 4 blocks an SM (new) against 3
# (new with --blocks-scale 0.75, what the 4-stage build planned; s3p3) and HEAD's kernels (old).
set -uo pipefail
export BENCH_TIMEOUT=120
source kernels/bench/lib.sh .stage "$OUT"
for r in 1 2 3; do
  for v in old new s3p3; do
    bin=$b/pagedattn-bench; [ $v = old ] && bin=$b/pagedattn-bench-old
    extra=(); [ $v = s3p3 ] && extra=(--blocks-scale 0.75)
    bench def_${v}_r$r $bin --head-dim 64 --no-read-roofline "${extra[@]}"
    bench kv1_${v}_r$r $bin --head-dim 64 --kv-heads 1 --cases "1,32768 1,131072" --no-read-roofline "${extra[@]}"
    bench mha_${v}_r$r $bin --head-dim 64 --q-heads 32 --kv-heads 32 --cases "1,32768 64,2048" --no-read-roofline "${extra[@]}"
  done
done
python3 kernels/bench/merge_rows.py "$tmp" "$out/ab.json" > /dev/null
python3 kernels/bench/rounds.py "$out/ab.json"
python3 - "$out/ab.json" <<'PY'
import json, sys
seen = set()
for r in json.load(open(sys.argv[1])):
    k = (r["variant"].rsplit("_r", 1)[0], r["kv_heads"], r["batch"], r["ctx"])
    if k in seen: continue
    seen.add(k)
    print(*k, "blocks", r.get("blocks"), "chunk", r.get("kv_chunk"), "merge", r.get("merge"))
PY
