#!/bin/bash
# Thirteenth session, after the review: the prefill kernels take their work item and kv head from
# the decode tile's ItemMajor (a multiply-shift, no integer division; decode SASS unchanged, checked
# here with cuobjdump). Every GPU test, then the prefill rows of the bench (checked against the
# float64 reference before and after timing) on both prefill kernels.
O=$1
mkdir -p .stage && tar xJf .stage-pack/stage.tar.xz -C .stage
bash kernels/bench/run_tests.sh .stage "$O"
source kernels/bench/lib.sh .stage "$O"
bench prefill $b/pagedattn-bench --suite prefill --reps 10
bench prefill_portable $b/pagedattn-bench --suite prefill --prefill-path portable --reps 10
bench prefill_d64 $b/pagedattn-bench --suite prefill --head-dim 64 --cases "4,4096" --reps 10
bench prefill_d256 $b/pagedattn-bench --suite prefill --head-dim 256 --cases "4,4096" --reps 10
python3 kernels/bench/merge_rows.py "$tmp" "$O/prefill.json"
