#!/usr/bin/env bash
# Decode beyond the default configuration, pagedattn-bench and peers.py on the same shapes in one
# call: head_dim 64 and 256, 64 q / 8 kv heads, MHA (32 / 32), float16, and group sizes other
# than 4: 28 q / 4 kv (7), 40 q / 8 kv (5), 16 q / 8 kv (2), 8 q / 1 kv (8 on one kv head);
# short contexts (small) and longer ones (long) at the default heads.
#
#   there:  bash kernels/bench/run_beyond_defaults.sh .stage $OUT          (carry [".stage"])
#           ONLY="gqa7 gqa5" bash kernels/bench/run_beyond_defaults.sh ...  (those groups only)
#   here:   python3 kernels/bench/compare.py OUT/ours.json OUT/peers.json
set -uo pipefail
source "$(dirname "$0")/lib.sh"
mkdir -p "$tmp/peers"
both() {  # name, shapes, then flags shared by pagedattn-bench and peers.py
  local name=$1 shapes=$2
  shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  bench "ours/$name" "$b/pagedattn-bench" --cases "$shapes" --no-read-roofline --reps 30 "$@"
  timeout 150 python3 "$stage/peers.py" --decode "$shapes" --prefill none --no-limits "$@" \
    --out "$tmp/peers/$name.json" > /dev/null 2>> "$out/peers.log" || echo "peers $name failed rc=$?"
}
defaults="1,32768 16,4096 64,4096 256,2048 128,8192"
both d64 "$defaults" --head-dim 64
both d256 "$defaults" --head-dim 256
both gqa8 "1,32768 16,4096 64,4096" --q-heads 64 --kv-heads 8
both mha "1,32768 16,4096 64,2048" --q-heads 32 --kv-heads 32
both f16 "1,32768 256,2048" --dtype float16
both gqa7 "1,32768 16,4096 64,4096 128,8192" --q-heads 28 --kv-heads 4
both gqa5 "1,32768 16,4096 64,4096" --q-heads 40 --kv-heads 8
both gqa2 "1,32768 16,4096 64,4096" --q-heads 16 --kv-heads 8
both kv1gqa8 "1,32768 16,4096 64,4096" --q-heads 8 --kv-heads 1
both small "4,512 8,2048 32,1024 64,512 256,512"
both long "1,131072 2,65536 4,32768 8,16384"
python3 "$(dirname "$0")/merge_rows.py" "$tmp/ours" "$out/ours.json" > /dev/null
python3 -c "
import json, os, sys
rows = []
for n in sorted(os.listdir('$tmp/peers')):
    rows += json.load(open(os.path.join('$tmp/peers', n)))
json.dump(rows, open('$out/peers.json', 'w'), indent=1)"
python3 "$(dirname "$0")/compare.py" "$out/ours.json" "$out/peers.json"
