#!/usr/bin/env bash
# The GPU machine's tests, from a stage: the wgmma layout test, the kernel tests (and the prefill
# ones again on the portable kernel), the CUDA end-to-end suite, the CUDA-against-CPU parity
# test, and the server with `pagedattn-cli smoke`; each binary the stage lacks is left out.
# The full log goes to OUT/tests.log; one line per binary (and gtest's summaries) to stdout.
#
#   there:  bash kernels/bench/run_tests.sh .stage $OUT          (carry [".stage"])
set -uo pipefail
source "$(dirname "$0")/lib.sh"
{
  [ -x "$b/wgmma_layout_test" ] && { timeout 60 "$b/wgmma_layout_test"; echo "wgmma_layout_test rc=$?"; }
  timeout 240 "$b/cuda_backend_test"; echo "cuda_backend_test rc=$?"
  PAGEDATTN_PREFILL_KERNEL=portable timeout 120 "$b/cuda_backend_test" --gtest_filter='*Prefill*:*Mixed*:*Odd*'
  echo "cuda_backend_test(portable prefill) rc=$?"
  [ -x "$b/e2e_test" ] && { PAGEDATTN_E2E_BACKEND=cuda timeout 200 "$b/e2e_test"; echo "e2e_test(cuda) rc=$?"; }
  [ -x "$b/backend_parity_test" ] && { timeout 100 "$b/backend_parity_test"; echo "backend_parity_test rc=$?"; }
  if [ -x "$b/pagedattn-server" ] && [ -x "$b/pagedattn-cli" ]; then
    "$b/pagedattn-server" --listen=127.0.0.1:50051 --health_listen=127.0.0.1:50052 &
    server=$!
    sleep 3
    timeout 60 "$b/pagedattn-cli" --target=127.0.0.1:50051 smoke; echo "cli smoke rc=$?"
    kill -TERM "$server"; wait "$server"; echo "server exit rc=$?"
  fi
} > "$out/tests.log" 2>&1
grep -E "rc=|^\[  (FAILED|PASSED)|Failure|is .*want|PASS|FAIL" "$out/tests.log" | head -40
