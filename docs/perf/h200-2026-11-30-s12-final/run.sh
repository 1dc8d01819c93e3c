#!/bin/bash
# The twelfth session's last call, on 88c8ee0: every GPU test (kernels/bench/run_tests.sh), the
# decode rows of the suite (default shapes with the read roofline, pages 64 / 128 / 1, 1 and 2
# kv heads), peers.py's decode peers on the same shapes, then four more default decode runs
# (per-launch samples at 1 x 32768). Prefill is unchanged since the eleventh session and left out.
O=$1
mkdir -p .stage && tar xJf .stage-pack/stage.tar.xz -C .stage
source kernels/bench/lib.sh .stage $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
bash kernels/bench/run_tests.sh .stage $O
run() { bench "$1" "$b/pagedattn-bench" "${@:2}"; }
run decode
run decode_p64 --page-size 64 --no-read-roofline
run decode_p128 --page-size 128 --no-read-roofline
run decode_p1 --page-size 1 --cases "1,32768 16,4096" --no-read-roofline
run decode_kv1 --kv-heads 1 --cases "1,32768 8,4096 1,131072" --no-read-roofline
run decode_kv2 --kv-heads 2 --cases "1,32768 2,16384" --no-read-roofline
python3 kernels/bench/merge_rows.py "$tmp" "$O/ours.json"
timeout 200 python3 "$stage/peers.py" --prefill none --out "$O/peers.json" > "$O/peers.log" 2>&1; echo "peers rc=$?"
timeout 100 python3 "$stage/peers.py" --no-limits --prefill none --kv-heads 1 \
  --decode "1,32768 8,4096 1,131072" --out "$tmp/peers_kv1.json" >> "$O/peers.log" 2>&1
timeout 100 python3 "$stage/peers.py" --no-limits --prefill none --kv-heads 2 \
  --decode "1,32768 2,16384" --out "$tmp/peers_kv2.json" >> "$O/peers.log" 2>&1
python3 - "$O/peers.json" "$tmp"/peers_kv*.json <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
for extra in sys.argv[2:]:
    rows += json.load(open(extra))
json.dump(rows, open(sys.argv[1], "w"), indent=1)
PY
mkdir -p $tmp/extra
for r in 1 2 3 4; do bench extra/extra_r$r $b/pagedattn-bench --no-read-roofline; done
python3 kernels/bench/merge_rows.py $tmp/extra $O/decode_extra.json
python3 kernels/bench/compare.py $O/ours.json $O/peers.json | tail -30
python3 kernels/bench/rounds.py $O/decode_extra.json
