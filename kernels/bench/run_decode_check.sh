#!/usr/bin/env bash
# One GPU-machine call that checks a decode change end to end (run from the repository root,
# the stage in .stage, carry [".stage"]): kernel, CUDA end-to-end and parity tests; the default
# decode shapes with their read roofline and peers.py's decode rows; three alternating rounds
# at 1 x 32768 of the planned split-KV merge against the tile kernel's own (--merge in-kernel);
# then run_beyond_defaults.sh into OUT/beyond. Prints the comparison tables.
#
#   there:  bash kernels/bench/run_decode_check.sh
source .stage/env.sh; B=.stage/bin/pagedattn-bench
{ timeout 240 .stage/bin/kernel_tests; echo "kernel_tests rc=$?"; PAGEDATTN_E2E_BACKEND=cuda timeout 200 .stage/bin/e2e_tests; echo "e2e_tests(cuda) rc=$?"; timeout 100 .stage/bin/backend_parity_test; echo "parity rc=$?"; } > $OUT/tests.log 2>&1
grep -E "rc=|^\[  (FAILED|PASSED)|Failure" $OUT/tests.log | head -20
timeout 120 $B --json $OUT/decode.json > /dev/null; echo "decode rc=$?"
timeout 200 python3 .stage/peers.py --prefill none --out $OUT/peers_decode.json > $OUT/peers.log 2>&1; echo "peers rc=$?"
for r in 1 2 3; do for m in planned in-kernel; do timeout 60 $B --cases "1,32768" --merge $m --no-read-roofline --json /tmp/m.json >/dev/null 2>&1; python3 -c "import json;r=json.load(open('/tmp/m.json'))[0];print('merge_ab $r $m ev=%.2f b2b=%.2f tbps=%.3f merge=%s'%(r['time_us'],r['b2b_time_us'],r['tbps'],r['merge']))" | tee -a $OUT/merge_ab.txt; done; done
mkdir -p $OUT/beyond; bash kernels/bench/run_beyond_defaults.sh .stage $OUT/beyond 2>&1 | tail -40
python3 kernels/bench/compare.py $OUT/decode.json $OUT/peers_decode.json 2>&1 | grep -E "^\| [0-9]|Limits"
