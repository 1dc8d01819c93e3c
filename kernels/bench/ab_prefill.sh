#!/usr/bin/env bash
# Same-call A/B of two pagedattn-bench binaries on the prefill shapes, in alternating rounds,
# then peers.py's prefill rows (flash, flex, cudnn) of the same call.
#
#   there:  bash kernels/bench/ab_prefill.sh .stage $OUT .stage/bin/pagedattn-bench-old [ROUNDS]
#   here:   python3 kernels/bench/compare.py OUT/ab.json OUT/peers.json
# Rows carry "variant": new, new_1job (one block per job: --prefill-blocks 1000000), old.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
old=$3
rounds=${4:-2}
for r in $(seq 1 "$rounds"); do
  bench "new_r$r" "$b/pagedattn-bench" --suite prefill
  bench "old_r$r" "$old" --suite prefill
  bench "new_1job_r$r" "$b/pagedattn-bench" --suite prefill --prefill-blocks 1000000
done
for d in 64 256; do
  bench "new_d$d" "$b/pagedattn-bench" --suite prefill --head-dim $d --cases "4,4096 2,8192" --reps 20
  bench "new_1job_d$d" "$b/pagedattn-bench" --suite prefill --head-dim $d --cases "4,4096 2,8192" --reps 20 --prefill-blocks 1000000
  bench "old_d$d" "$old" --suite prefill --head-dim $d --cases "4,4096 2,8192" --reps 20
done
bench new_p1 "$b/pagedattn-bench" --suite prefill --page-size 1 --cases "1,4096" --reps 10
bench new_p128 "$b/pagedattn-bench" --suite prefill --page-size 128
# One file of rows, each tagged with the run it came from.
python3 "$(dirname "$0")/merge_rows.py" "$tmp" "$out/ab.json"
if [ "${PEERS:-1}" != 0 ]; then
  timeout 200 python3 "$stage/peers.py" --decode none --no-limits --out "$out/peers.json" > "$out/peers.log" 2>&1
  echo "peers rc=$?"
  python3 -c "
import json,sys
for r in json.load(open('$out/peers.json')): print(r.get('suite'), r.get('batch'), r.get('seqlen'), r.get('peer'), r.get('tflops'))"
fi
