#!/usr/bin/env bash
# Decode at page sizes 16, 64 and 128 in alternating rounds (the default shapes), and page 1
# once, in one GPU-machine call: OUT/pages.json, one row per run tagged with its variant.
#
#   there:  bash kernels/bench/run_page_sizes.sh .stage $OUT [ROUNDS]     (carry [".stage"])
set -uo pipefail
source "$(dirname "$0")/lib.sh"
rounds=${3:-2}
for r in $(seq 1 "$rounds"); do
  for ps in 16 64 128; do bench "p${ps}_r$r" "$b/pagedattn-bench" --page-size $ps --no-read-roofline; done
done
bench p1 "$b/pagedattn-bench" --page-size 1 --cases "1,32768 16,4096" --no-read-roofline
python3 "$(dirname "$0")/merge_rows.py" "$tmp" "$out/pages.json" > /dev/null
python3 - "$out/pages.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
for r in sorted(rows, key=lambda r: (r["batch"], r["ctx"], r["variant"])):
    print(r["variant"], r["batch"], r["ctx"], "page", r["page_size"], "us %.1f b2b %.1f TB/s %.3f err %.2g merge %s"
          % (r["time_us"], r["b2b_time_us"], r["tbps"], r["max_rel_err"], r["merge"]))
PY
