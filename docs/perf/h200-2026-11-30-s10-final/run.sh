#!/bin/bash
# final check of the tenth session's HEAD: the tests, the bench's shipped path, --stages 3 and the
# --exp 32 timeline (Launch changed), default decode once
O=$1
mkdir -p .stage && tar xJf .stage-pack/stage.tar.xz -C .stage
b=.stage/bin; source .stage/env.sh
{
  timeout 60 $b/wgmma_layout_test; echo "wgmma_layout_test rc=$?"
  timeout 240 $b/kernel_tests; echo "kernel_tests rc=$?"
  PAGEDATTN_E2E_BACKEND=cuda timeout 200 $b/e2e_tests; echo "e2e_tests(cuda) rc=$?"
  timeout 100 $b/backend_parity_test; echo "backend_parity_test rc=$?"
  $b/pagedattn-server --listen=127.0.0.1:50051 --health_listen=127.0.0.1:50052 & s=$!; sleep 3
  timeout 60 $b/pagedattn-cli --target=127.0.0.1:50051 smoke; echo "cli smoke rc=$?"
  kill -TERM $s; wait $s; echo "server exit rc=$?"
} > $O/tests.log 2>&1
grep -E "rc=|^\[  (FAILED|PASSED)" $O/tests.log
mkdir -p /tmp/f
timeout 150 $b/pagedattn-bench --no-read-roofline --json /tmp/f/decode.json > /dev/null 2>&1; echo "bench rc=$?"
timeout 60 $b/pagedattn-bench --cases "1,32768 16,4096" --stages 3 --no-read-roofline --json /tmp/f/stages3.json > /dev/null 2>&1; echo "bench --stages 3 rc=$?"
timeout 60 $b/pagedattn-bench --cases "1,32768" --exp 32 --reps 20 --no-read-roofline --json $O/tl.json > $O/tl.txt 2>&1; echo "bench --exp 32 rc=$?"
python3 kernels/bench/merge_rows.py /tmp/f $O/ours.json
