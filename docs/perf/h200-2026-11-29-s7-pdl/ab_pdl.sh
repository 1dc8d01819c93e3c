#!/usr/bin/env bash
# PDL separate-merge A/B (temporary).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
old=$b/pagedattn-bench-old
timeout 300 "$b/kernel_tests" --gtest_filter="${TESTS:-*ManySplitWide*:*GraphAndPlain*:*RaggedLong*:*LaunchInto*:AttentionPlan*}" > "$out/tests.log" 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]|OK \]" "$out/tests.log" | tail -12
for r in 1 2; do
  bench "new_r$r" "$b/pagedattn-bench" --no-read-roofline
  bench "old_r$r" "$old" --no-read-roofline
  bench "newsep_r$r" "$b/pagedattn-bench" --no-read-roofline --merge separate --cases "1,32768 16,4096"
  bench "oldsep_r$r" "$old" --no-read-roofline --merge separate --cases "1,32768 16,4096"
done
for d in 64 256; do
  bench "new_d$d" "$b/pagedattn-bench" --head-dim $d --no-read-roofline --reps 30
  bench "old_d$d" "$old" --head-dim $d --no-read-roofline --reps 30
  bench "newsep_d$d" "$b/pagedattn-bench" --head-dim $d --merge separate --cases "1,32768 16,4096" --no-read-roofline --reps 30
  bench "oldsep_d$d" "$old" --head-dim $d --merge separate --cases "1,32768 16,4096" --no-read-roofline --reps 30
done
few="1,32768 8,4096 1,131072"
for k in 1 2; do
  bench new_kv$k "$b/pagedattn-bench" --kv-heads $k --cases "$few" --no-read-roofline --reps 30
  bench old_kv$k "$old" --kv-heads $k --cases "$few" --no-read-roofline --reps 30
done
python3 "$(dirname "$0")/merge_rows.py" "$tmp" "$out/ab.json" > /dev/null
python3 - "$out/ab.json" <<'PY'
import json,sys
rows=json.load(open(sys.argv[1]))
for r in sorted(rows,key=lambda r:(r['kv_heads'],r['head_dim'],r['batch'],r['variant'])):
  print(r['variant'],r['kv_heads'],r['head_dim'],r['batch'],r['ctx'],'ev=%.2f b2b=%.2f tbps=%.3f merge=%s err=%.2g'%(r['time_us'],r['b2b_time_us'],r['tbps'],r['merge'],r['max_rel_err']))
PY
