#!/usr/bin/env bash
# Thirteenth session, call 8: the commit's build (head_dim 64 tile at 3 stages; the planner's
# blocks per SM leave room for a separate-merge block: 3 at head_dim 64, 2 at 128 as before)
# against HEAD b2b5f69's kernels (old): kernel tests and the CUDA end-to-end suite on new, then
# two alternating rounds of head_dim 64 shapes, one of head_dim 128 (plans must not change), and
# peers.py on the head_dim 64 default shapes.
set -uo pipefail
export BENCH_TIMEOUT=120
source kernels/bench/lib.sh .stage "$OUT"
$b/kernel_tests > "$out/kt.log" 2>&1; echo "kernel_tests rc=$?"
grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$out/kt.log" | head
PAGEDATTN_E2E_BACKEND=cuda timeout 200 $b/e2e_tests > "$out/e2e.log" 2>&1; echo "e2e_tests(cuda) rc=$?"
grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$out/e2e.log" | head
for r in 1 2; do
  for v in old new; do
    bin=$b/pagedattn-bench; [ $v = old ] && bin=$b/pagedattn-bench-old
    bench def_${v}_r$r $bin --head-dim 64 --no-read-roofline
    bench kv1_${v}_r$r $bin --head-dim 64 --kv-heads 1 --cases "1,32768 8,4096 1,131072" --no-read-roofline
    bench kv2_${v}_r$r $bin --head-dim 64 --kv-heads 2 --cases "1,32768 2,16384" --no-read-roofline
    bench mha_${v}_r$r $bin --head-dim 64 --q-heads 32 --kv-heads 32 --cases "1,32768 16,4096 64,2048" --no-read-roofline
    bench p1_${v}_r$r $bin --head-dim 64 --page-size 1 --cases "1,32768 16,4096" --no-read-roofline --reps 30
    bench gqa8_${v}_r$r $bin --head-dim 64 --q-heads 64 --cases "1,32768 16,4096 64,4096" --no-read-roofline
  done
done
for v in old new; do
  bin=$b/pagedattn-bench; [ $v = old ] && bin=$b/pagedattn-bench-old
  bench d128_${v}_r1 $bin --no-read-roofline
  bench d128kv1_${v}_r1 $bin --kv-heads 1 --cases "1,32768 1,131072" --no-read-roofline
  bench d256_${v}_r1 $bin --head-dim 256 --cases "1,32768 16,4096" --no-read-roofline
done
python3 kernels/bench/merge_rows.py "$tmp" "$out/ab.json" > /dev/null
timeout 150 python3 "$stage/peers.py" --prefill none --no-limits --head-dim 64 --out "$out/peers_d64.json" > "$out/peers.log" 2>&1
echo "peers rc=$?"
python3 kernels/bench/rounds.py "$out/ab.json"
python3 - "$out/ab.json" <<'PY'
import json, sys
plans = {}
for r in json.load(open(sys.argv[1])):
    v = r["variant"].rsplit("_r", 1)[0]
    kind, ver = v.rsplit("_", 1)
    plans.setdefault((kind, r["head_dim"], r["kv_heads"], r["q_heads"], r["batch"], r["ctx"], r["page_size"]), {})[ver] = (r.get("blocks"), r.get("kv_chunk"), r.get("merge"))
for k, p in sorted(plans.items()):
    print("plan", *k, "old", p.get("old"), "new", p.get("new"))
PY
