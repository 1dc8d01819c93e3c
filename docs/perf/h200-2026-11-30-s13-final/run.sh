#!/bin/bash
# The thirteenth session's check of HEAD b2b5f69 (the seven binaries packed, carry
# [".stage-pack"]): every GPU test, the decode rows of the suite with peers.py (PREFILL=0: the
# prefill kernels are unchanged since the eleventh session), then four more default decode runs
# with the plain-read roofline (per-launch samples at 1 x 32768, each beside a plain streaming read
# of the same bytes in the same process).
O=$1
mkdir -p .stage && tar xJf .stage-pack/stage.tar.xz -C .stage
PREFILL=0 bash kernels/bench/run_h200_suite.sh .stage "$O" > "$O/suite.log" 2>&1
grep -E "rc=|PASSED|FAILED|PASS|FAIL" "$O/tests.log" | head -20
source kernels/bench/lib.sh .stage "$O"
mkdir -p "$tmp/extra"
for r in 1 2 3 4; do bench extra/extra_r$r $b/pagedattn-bench --cases "1,32768 16,4096"; done
python3 kernels/bench/merge_rows.py "$tmp/extra" "$O/decode_extra.json" > /dev/null
python3 kernels/bench/compare.py "$O/ours.json" "$O/peers.json" | tail -30
python3 kernels/bench/rounds.py "$O/decode_extra.json"
python3 - "$O/decode_extra.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["variant"], r["batch"], r["ctx"], "us", r["time_us"], "read_us", r.get("read_us"))
PY
