#!/usr/bin/env bash
# Thirteenth session, call 1: HEAD b2b5f69's kernel_tests (the carried-page-ids test with its
# control had not run on a GPU), then whether 1 x 32768's per-launch mode (fast ~37.8 us / slow
# ~38.9 us, set per process) follows the process's address layout: processes with and without
# address-space randomization (setarch -R), interleaved; then --exp 32's launch-floor line in
# four processes (host time of one launch, per mode).
set -uo pipefail
export BENCH_TIMEOUT=90
source kernels/bench/lib.sh .stage "$OUT"
$b/kernel_tests > "$out/kt.log" 2>&1; echo "kernel_tests rc=$?"
grep -E "^\[  (PASSED|FAILED)|FAILED  \]|Carried" "$out/kt.log" | head
cat /proc/sys/kernel/randomize_va_space
setarch "$(uname -m)" -R true && echo "setarch -R works" || echo "setarch -R refused"
for r in 1 2 3 4 5 6; do
  bench aslr_r$r $b/pagedattn-bench --cases "1,32768" --reps 200 --no-read-roofline
  bench norand_r$r setarch "$(uname -m)" -R $b/pagedattn-bench --cases "1,32768" --reps 200 --no-read-roofline
done
for r in 1 2 3; do
  CUDA_DEVICE_MAX_CONNECTIONS=1 bench conn1_r$r $b/pagedattn-bench --cases "1,32768" --reps 200 --no-read-roofline
  CUDA_MODULE_LOADING=EAGER bench eager_r$r $b/pagedattn-bench --cases "1,32768" --reps 200 --no-read-roofline
done
python3 kernels/bench/merge_rows.py "$tmp" "$out/ab.json" > /dev/null
python3 kernels/bench/rounds.py "$out/ab.json"
for r in 1 2 3 4; do
  $b/pagedattn-bench --cases "1,32768" --exp 32 --reps 20 --no-read-roofline --json /dev/null \
    > "$out/floor_$r.txt" 2>&1
  grep -h -E "launch_floor|launch_path" "$out/floor_$r.txt" | cut -c1-400
done
