#!/bin/bash
# Made the decode and beyond-the-defaults rows in this folder: 2026-11-30, commit 7c72672, one
# H200, run from that commit's checkout with its binaries packed in .stage-pack. Every GPU test,
# the decode rows of the suite with peers.py (PREFILL=0), four more runs of 1 x 32768 and
# 16 x 4096 (decode_extra.json), every group beyond the defaults beside peers.py (beyond/).
# Usage: run.sh OUT_DIR. Today kernels/bench/run_suite.sh does all of this in one command.
O=$1
mkdir -p .stage && tar xJf .stage-pack/stage.tar.xz -C .stage
PREFILL=0 bash kernels/bench/run_h200_suite.sh .stage "$O" > "$O/suite.log" 2>&1
grep -E "rc=|PASSED|FAILED|PASS|FAIL" "$O/tests.log" | head -20
source kernels/bench/lib.sh .stage "$O"
mkdir -p "$tmp/extra"
for r in 1 2 3 4; do bench extra/extra_r$r $b/pagedattn-bench --cases "1,32768 16,4096"; done
python3 kernels/bench/merge_rows.py "$tmp/extra" "$O/decode_extra.json" > /dev/null
python3 kernels/bench/compare.py "$O/ours.json" "$O/peers.json" | tail -24
python3 kernels/bench/rounds.py "$O/decode_extra.json"
mkdir -p "$O/beyond"
BENCH_TIMEOUT=200 bash kernels/bench/run_beyond_defaults.sh .stage "$O/beyond" > "$O/beyond/compare.md" 2>&1
tail -40 "$O/beyond/compare.md"
