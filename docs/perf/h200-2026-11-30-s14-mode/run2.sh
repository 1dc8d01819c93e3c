#!/bin/bash
# Fourteenth session, call 4: the default decode shapes with the pools first evicted from L2
# (the bench's new default) against --no-flush-l2 (as every earlier call timed), four
# alternating processes each; --trials 3 at 1 x 32768 with the flush; then peers.py's decode
# rows in the same call. carry [".stage"] (the bench only).
O=$1
source kernels/bench/lib.sh .stage "$O"
B=$b/pagedattn-bench
for r in 1 2 3 4; do
  bench ab/flush_r$r $B --no-read-roofline
  bench ab/noflush_r$r $B --no-read-roofline --no-flush-l2
done
bench ab/flushroof_r1 $B
python3 kernels/bench/merge_rows.py "$tmp/ab" "$O/ab.json" > /dev/null
python3 kernels/bench/rounds.py "$O/ab.json"
for r in 1 2; do
  "$B" --cases "1,32768" --trials 3 --no-read-roofline --json "$O/t$r.json" 2>&1 | grep -E '"trial"'
done
timeout 300 python3 .stage/peers.py --prefill none --out "$O/peers.json" > "$O/peers.log" 2>&1
echo "peers rc=$?"
python3 - "$O/peers.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print({k: r.get(k) for k in ("suite", "peer", "batch", "ctx", "time_us", "tbps", "hbm_read_tbps", "metric", "value") if k in r})
PY
