#!/bin/bash
# Made the prefill rows in this folder (ours.json also holds that run's decode rows): 2026-11-30,
# commit 790ab6e, one H200, run from that commit's checkout with its binaries packed in
# .stage-pack. The whole suite with peers.py, then two more default decode runs.
# Usage: run.sh OUT_DIR.
O=$1
mkdir -p .stage && tar xJf .stage-pack/stage.tar.xz -C .stage
bash kernels/bench/run_h200_suite.sh .stage $O
source kernels/bench/lib.sh .stage $O
for r in 1 2; do bench extra_r$r $b/pagedattn-bench --no-read-roofline; done
python3 kernels/bench/merge_rows.py $tmp $O/decode_extra.json
