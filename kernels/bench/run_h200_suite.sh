#!/usr/bin/env bash
# One GPU-machine call for docs/PERFORMANCE.md: the layout, kernel (both prefill kernels),
# end-to-end and parity tests, then pagedattn-bench (prefill on the Hopper and the portable
# kernel, page sizes, decode with its read roofline) and peers.py, so every ratio compares
# numbers taken on the same card in the same call.
#
#   here:   scripts/build.sh build && ../shared/device/stage.sh .stage build/tests/cuda_backend_test \
#             build/tests/wgmma_layout_test build/tests/e2e_test build/tests/backend_parity_test \
#             build/server/pagedattn-server build/client/pagedattn-cli build/kernels/bench/pagedattn-bench
#   there:  bash kernels/bench/run_h200_suite.sh .stage $OUT        (carry [".stage"])
#   here:   python3 kernels/bench/compare.py OUT/ours.json OUT/peers.json
#
# SKIP_TESTS=1 leaves the tests out; PREFILL=0 the prefill runs (ours and peers.py's); PEERS=0
# leaves peers.py out.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader

if [ "${SKIP_TESTS:-0}" != 1 ]; then bash "$(dirname "$0")/run_tests.sh" "$stage" "$out"; fi

run() { bench "$1" "$b/pagedattn-bench" "${@:2}"; }
if [ "${PREFILL:-1}" != 0 ]; then
  run prefill --suite prefill
  run prefill_portable --suite prefill --prefill-path portable
  run prefill_p128 --suite prefill --page-size 128
  run prefill_p1 --suite prefill --page-size 1 --cases "1,4096" --reps 10
  run prefill_d64 --suite prefill --head-dim 64 --cases "4,4096 2,8192" --reps 20
  run prefill_d256 --suite prefill --head-dim 256 --cases "4,4096 2,8192" --reps 20
  run prefill_f16 --suite prefill --dtype float16 --cases "2,8192" --reps 20
fi
run decode
run decode_p64 --page-size 64 --no-read-roofline
run decode_p128 --page-size 128 --no-read-roofline
run decode_p1 --page-size 1 --cases "1,32768 16,4096" --no-read-roofline
# Few kv heads (wide tiles, many splits, the separate merge), with peers.py rows of the same shapes.
run decode_kv1 --kv-heads 1 --cases "1,32768 8,4096 1,131072" --no-read-roofline
run decode_kv2 --kv-heads 2 --cases "1,32768 2,16384" --no-read-roofline
# One file of rows, each tagged with the run it came from.
python3 "$(dirname "$0")/merge_rows.py" "$tmp" "$out/ours.json"
if [ "${PEERS:-1}" != 0 ]; then
  peers_prefill=(); [ "${PREFILL:-1}" = 0 ] && peers_prefill=(--prefill none)
  timeout 300 python3 "$stage/peers.py" "${peers_prefill[@]}" --out "$out/peers.json" > "$out/peers.log" 2>&1
  echo "peers rc=$?"
  timeout 100 python3 "$stage/peers.py" --no-limits --prefill none --kv-heads 1 \
    --decode "1,32768 8,4096 1,131072" --out "$tmp/peers_kv1.json" >> "$out/peers.log" 2>&1
  timeout 100 python3 "$stage/peers.py" --no-limits --prefill none --kv-heads 2 \
    --decode "1,32768 2,16384" --out "$tmp/peers_kv2.json" >> "$out/peers.log" 2>&1
  python3 - "$out/peers.json" "$tmp"/peers_kv*.json <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
for extra in sys.argv[2:]:
    rows += json.load(open(extra))
json.dump(rows, open(sys.argv[1], "w"), indent=1)
PY
  python3 - "$out/peers.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r.get("suite"), r.get("batch"), r.get("seqlen", r.get("ctx")), r.get("peer"), r.get("tflops", r.get("tbps")))
PY
fi
