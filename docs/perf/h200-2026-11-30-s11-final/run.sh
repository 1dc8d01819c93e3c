#!/bin/bash
# The eleventh session's last call: HEAD (the tenth session's kernels, the bench checking again
# after timing) through the whole suite with peers (kernels/bench/run_h200_suite.sh), then two
# more default decode runs (per-launch samples at 1 x 32768).
O=$1
mkdir -p .stage && tar xJf .stage-pack/stage.tar.xz -C .stage
bash kernels/bench/run_h200_suite.sh .stage $O
source kernels/bench/lib.sh .stage $O
for r in 1 2; do bench extra_r$r $b/pagedattn-bench --no-read-roofline; done
python3 kernels/bench/merge_rows.py $tmp $O/decode_extra.json
