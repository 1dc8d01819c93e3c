#!/usr/bin/env bash
# Thirteenth session, call 5: why head_dim 64 decode reads slower than head_dim 128 at large
# batches (beyond/: 4.08 / 4.18 / 4.39 against 4.42 / 4.48 / 4.56 TB/s; 0.99x cuDNN at 256 x 2048).
# The shipped head_dim 64 tile (4 stages, 3 blocks an SM) against 3 stages (4 blocks an SM) and 5
# (2 blocks), pages 64 / 128, more blocks; head_dim 128 beside it; two rounds.
set -uo pipefail
export BENCH_TIMEOUT=120
source kernels/bench/lib.sh .stage "$OUT"
big="64,4096 256,2048 128,8192"
for r in 1 2; do
  bench d64_r$r $b/pagedattn-bench --head-dim 64 --cases "$big"
  bench d64s3_r$r $b/pagedattn-bench --head-dim 64 --cases "$big" --stages 3 --no-read-roofline
  bench d64s5_r$r $b/pagedattn-bench --head-dim 64 --cases "$big" --stages 5 --no-read-roofline
  bench d64p64_r$r $b/pagedattn-bench --head-dim 64 --cases "$big" --page-size 64 --no-read-roofline
  bench d64p128_r$r $b/pagedattn-bench --head-dim 64 --cases "$big" --page-size 128 --no-read-roofline
  bench d64bs2_r$r $b/pagedattn-bench --head-dim 64 --cases "$big" --blocks-scale 2 --no-read-roofline
  bench d128_r$r $b/pagedattn-bench --cases "$big"
done
python3 kernels/bench/merge_rows.py "$tmp" "$out/ab.json" > /dev/null
python3 kernels/bench/rounds.py "$out/ab.json"
python3 - "$out/ab.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    if r.get("read_us"):
        print(r["variant"], r["batch"], r["ctx"], "tbps", r["tbps"], "read_tbps", r["read_tbps"], "blocks", r.get("blocks"), "chunk", r.get("kv_chunk"))
PY
