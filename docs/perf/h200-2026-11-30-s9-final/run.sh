#!/bin/bash
# final check of 22451c8: the tests, default decode three times, peers.py decode
O=$1
mkdir -p .stage && tar xJf .stage-pack/stage.tar.xz -C .stage
b=.stage/bin; source .stage/env.sh
{
  timeout 60 $b/wgmma_layout_test; echo "wgmma_layout_test rc=$?"
  timeout 240 $b/kernel_tests; echo "kernel_tests rc=$?"
  PAGEDATTN_PREFILL_KERNEL=portable timeout 120 $b/kernel_tests --gtest_filter='*Prefill*:*Mixed*:*Odd*'; echo "kernel_tests(portable prefill) rc=$?"
  PAGEDATTN_E2E_BACKEND=cuda timeout 200 $b/e2e_tests; echo "e2e_tests(cuda) rc=$?"
  timeout 100 $b/backend_parity_test; echo "backend_parity_test rc=$?"
  $b/pagedattn-server --listen=127.0.0.1:50051 --health_listen=127.0.0.1:50052 & s=$!; sleep 3
  timeout 60 $b/pagedattn-cli --target=127.0.0.1:50051 smoke; echo "cli smoke rc=$?"
  kill -TERM $s; wait $s; echo "server exit rc=$?"
} > $O/tests.log 2>&1
grep -E "rc=|^\[  (FAILED|PASSED)" $O/tests.log
mkdir -p /tmp/f
for r in 1 2 3; do timeout 150 $b/pagedattn-bench --no-read-roofline --json /tmp/f/decode_r$r.json > /dev/null 2>&1; done
python3 kernels/bench/merge_rows.py /tmp/f $O/ours.json
timeout 200 python3 .stage/peers.py --prefill none --out $O/peers.json > $O/peers.log 2>&1; echo "peers rc=$?"
