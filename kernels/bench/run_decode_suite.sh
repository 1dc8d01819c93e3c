#!/usr/bin/env bash
# The GPU-machine run behind docs/PERFORMANCE.md: kernel/e2e tests, then pagedattn-bench and
# peers.py in one call, so ratios compare numbers taken on the same card at the same time.
#
#   ../shared/device/stage.sh .stage-cuda build-cuda/tests/kernel_tests \
#       build-cuda/kernels/bench/pagedattn-bench build-cuda/tests/e2e_tests build-cuda/tests/backend_parity_test
#   (on the GPU machine) kernels/bench/run_decode_suite.sh .stage-cuda $OUT
#   (here) python3 kernels/bench/compare.py OUT/ours.json OUT/peers.json
set -uo pipefail
stage=$1
out=$2
bin=$stage/bin
source "$stage/env.sh"

if [ -x "$bin/kernel_tests" ]; then
  {
    timeout 200 "$bin/kernel_tests"; echo "kernel_tests rc=$?"
    [ -x "$bin/e2e_tests" ] && { PAGEDATTN_E2E_BACKEND=cuda timeout 200 "$bin/e2e_tests"; echo "e2e_tests(cuda) rc=$?"; }
    [ -x "$bin/backend_parity_test" ] && { timeout 100 "$bin/backend_parity_test"; echo "backend_parity_test rc=$?"; }
  } > "$out/tests.log" 2>&1
  grep -E "rc=|^\[  (FAILED|PASSED)" "$out/tests.log"
fi

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
b=$bin/pagedattn-bench
"$b" --json "$out/ours.json" > /dev/null || exit 1
tmp=$(mktemp -d)
"$b" --page-size 64 --json "$tmp/p64.json" > /dev/null
"$b" --page-size 128 --json "$tmp/p128.json" > /dev/null
"$b" --page-size 1 --cases "1,32768 16,4096" --json "$tmp/p1.json" > /dev/null
"$b" --dtype float16 --json "$tmp/f16.json" > /dev/null
"$b" --q-heads 64 --kv-heads 8 --json "$tmp/q64.json" > /dev/null
"$b" --cases "1,32768" --rotate 2 --json "$tmp/rot.json" > /dev/null
python3 - "$tmp" "$out/ours_variants.json" <<'EOF'
import glob, json, os, sys
rows = []
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    for r in json.load(open(path)):
        r["variant"] = os.path.basename(path)[:-5]
        rows.append(r)
json.dump(rows, open(sys.argv[2], "w"), indent=1)
EOF

p=$stage/peers.py
python3 "$p" --prefill none --out "$out/peers.json" > /dev/null 2>&1
python3 "$p" --prefill none --no-limits --dtype float16 --out "$tmp/peers_f16.json" > /dev/null 2>&1
python3 "$p" --prefill none --no-limits --q-heads 64 --kv-heads 8 --out "$tmp/peers_q64.json" > /dev/null 2>&1
python3 -c "import json,sys; json.dump(json.load(open(sys.argv[1]))+json.load(open(sys.argv[2])), open(sys.argv[3],'w'), indent=1)" \
  "$tmp/peers_f16.json" "$tmp/peers_q64.json" "$out/peers_more.json"

# Short summary last (the reply carries the end of the output).
python3 - "$out" <<'EOF'
import json, os, sys
o = sys.argv[1]
peers = json.load(open(os.path.join(o, "peers.json"))) + json.load(open(os.path.join(o, "peers_more.json")))
ours = json.load(open(os.path.join(o, "ours.json"))) + json.load(open(os.path.join(o, "ours_variants.json")))
lim = {r["name"]: r["value"] for r in peers if r.get("suite") == "limit"}
print("limits", {k: round(v, 3) for k, v in lim.items()})
k = lambda r: (r["batch"], r["ctx"], r["q_heads"], r["kv_heads"], r["head_dim"], r["dtype"])
cud = {k(r): r for r in peers if r.get("peer") == "cudnn" and "time_us" in r}
for r in ours:
    c = cud.get(k(r))
    print(r.get("variant", "default"), r["batch"], r["ctx"], r["q_heads"], r["kv_heads"], r["dtype"], "page", r["page_size"],
          "us %.1f TB/s %.3f" % (r["time_us"], r["tbps"]), "cudnn %.1f" % c["time_us"] if c else "", "x%.3f" % (c["time_us"] / r["time_us"]) if c else "")
EOF
