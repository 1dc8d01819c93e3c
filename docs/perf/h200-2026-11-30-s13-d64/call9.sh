#!/usr/bin/env bash
# Thirteenth session, call 9 (the seven binaries packed, carry [".stage-pack"]): every GPU test on
# the build that also plans a split-free launch in waves of all resident blocks (unsplit_blocks),
# then head_dim 64 shapes against HEAD b2b5f69's kernels (old), two alternating rounds, head_dim
# 128 one round (plans must not change), peers.py on head_dim 64's default shapes.
set -uo pipefail
mkdir -p .stage && tar xJf .stage-pack/stage.tar.xz -C .stage
export BENCH_TIMEOUT=120
source kernels/bench/lib.sh .stage "$OUT"
bash kernels/bench/run_tests.sh .stage "$out"
for r in 1 2; do
  for v in old new; do
    bin=$b/pagedattn-bench; [ $v = old ] && bin=$b/pagedattn-bench-old
    bench def_${v}_r$r $bin --head-dim 64 --no-read-roofline
    bench mha_${v}_r$r $bin --head-dim 64 --q-heads 32 --kv-heads 32 --cases "1,32768 16,4096 64,2048" --no-read-roofline
    bench gqa8_${v}_r$r $bin --head-dim 64 --q-heads 64 --cases "16,4096 64,4096" --no-read-roofline
    bench kv1_${v}_r$r $bin --head-dim 64 --kv-heads 1 --cases "1,32768 1,131072" --no-read-roofline
    bench p128_${v}_r$r $bin --head-dim 64 --page-size 128 --cases "64,4096 128,8192" --no-read-roofline
  done
done
for v in old new; do
  bin=$b/pagedattn-bench; [ $v = old ] && bin=$b/pagedattn-bench-old
  bench d128_${v}_r1 $bin --no-read-roofline
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
