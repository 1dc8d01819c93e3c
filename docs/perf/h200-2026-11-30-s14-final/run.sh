#!/bin/bash
# Fourteenth session's last call, on its last kernel commit (the seven binaries packed, carry
# [".stage-pack"]), every decode number with the bench's new default (the pools evicted from
# L2 before timing, by a read of a 4x-L2 buffer): every GPU test and the decode rows of the
# suite with peers.py (run_h200_suite.sh, PREFILL=0: the prefill kernels are unchanged since
# the eleventh session), four more default decode runs, and every group beyond the defaults
# beside peers.py (run_beyond_defaults.sh).
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
