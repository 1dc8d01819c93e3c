#!/bin/bash
# final check of the tenth session's HEAD after the review: the tests (run_tests.sh), the bench's
# shipped path (default shapes; 1 kv head, the separate merge), --stages 3 and the --exp 32
# timeline
O=$1
mkdir -p .stage && tar xJf .stage-pack/stage.tar.xz -C .stage
bash kernels/bench/run_tests.sh .stage $O
source kernels/bench/lib.sh .stage $O
bench decode $b/pagedattn-bench --no-read-roofline
bench kv1 $b/pagedattn-bench --kv-heads 1 --cases "1,32768 1,131072" --no-read-roofline
bench stages3 $b/pagedattn-bench --cases "1,32768 16,4096" --stages 3 --no-read-roofline
timeout 60 $b/pagedattn-bench --cases "1,32768" --exp 32 --reps 20 --no-read-roofline --json $O/tl.json > $O/tl.txt 2>&1; echo "bench --exp 32 rc=$?"
python3 kernels/bench/merge_rows.py $tmp $O/ours.json
