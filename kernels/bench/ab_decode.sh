#!/usr/bin/env bash
# Same-call A/B of two pagedattn-bench binaries on decode shapes, in alternating rounds (the
# default shapes), then head_dim 64 / 256, few kv heads and page sizes once each, then the
# new binary's phase timeline at 1 x 32768 (--exp 32; raw stamps in OUT/timeline*.csv).
#
#   there:  bash kernels/bench/ab_decode.sh .stage $OUT .stage/bin/pagedattn-bench-old [ROUNDS]
#   here:   python3 kernels/bench/compare.py OUT/ab.json OUT/peers.json
#           python3 kernels/bench/rounds.py OUT/ab.json   (each variant's rounds side by side)
# Rows carry "variant": the run's name (new_r1, old_r1, new_d64, ...). EXTRA="--stages 2" adds
# a run of the new binary per round with those flags (variant newx_rN).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
old=$3
rounds=${4:-2}
for r in $(seq 1 "$rounds"); do
  bench "new_r$r" "$b/pagedattn-bench" --no-read-roofline
  bench "old_r$r" "$old" --no-read-roofline
  [ -n "${EXTRA:-}" ] && bench "newx_r$r" "$b/pagedattn-bench" --no-read-roofline $EXTRA
done
for d in 64 256; do
  bench "new_d$d" "$b/pagedattn-bench" --head-dim $d --no-read-roofline --reps 30
  bench "old_d$d" "$old" --head-dim $d --no-read-roofline --reps 30
done
few="1,32768 8,4096 1,131072"
bench new_kv1 "$b/pagedattn-bench" --kv-heads 1 --cases "$few" --no-read-roofline --reps 30
bench old_kv1 "$old" --kv-heads 1 --cases "$few" --no-read-roofline --reps 30
bench new_kv2 "$b/pagedattn-bench" --kv-heads 2 --cases "1,32768 2,16384" --no-read-roofline --reps 30
bench old_kv2 "$old" --kv-heads 2 --cases "1,32768 2,16384" --no-read-roofline --reps 30
bench new_p1 "$b/pagedattn-bench" --page-size 1 --cases "1,32768 16,4096" --no-read-roofline --reps 30
bench new_p128 "$b/pagedattn-bench" --page-size 128 --no-read-roofline --reps 30
python3 "$(dirname "$0")/merge_rows.py" "$tmp" "$out/ab.json"
if [ "${TIMELINE:-1}" != 0 ]; then
  "$b/pagedattn-bench" --cases "1,32768" --exp 32 --reps 20 --no-read-roofline \
    --json "$out/timeline.json" > "$out/timeline.txt" 2>&1
  echo "timeline rc=$?"
fi
if [ "${PEERS:-1}" != 0 ]; then
  timeout 200 python3 "$stage/peers.py" --prefill none --no-limits --out "$out/peers.json" > "$out/peers.log" 2>&1
  echo "peers rc=$?"
fi
