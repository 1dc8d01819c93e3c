#!/usr/bin/env bash
# Call 12: kernel_tests with CudaKernelTest.CarriedFirstPagesGiveTheLoadedPagesResult (new), then
# run_h200_suite.sh with its new PREFILL=0 switch (tests and peers left out) on this build.
set -uo pipefail
source .stage/env.sh
.stage/bin/kernel_tests > "$OUT/kt.log" 2>&1; echo "kernel_tests rc=$?"
grep -E "^\[  (PASSED|FAILED)|FAILED  \]|Carried" "$OUT/kt.log" | head
SKIP_TESTS=1 PEERS=0 PREFILL=0 bash kernels/bench/run_h200_suite.sh .stage "$OUT" > "$OUT/suite.log" 2>&1
echo "suite rc=$?"; tail -25 "$OUT/suite.log"
