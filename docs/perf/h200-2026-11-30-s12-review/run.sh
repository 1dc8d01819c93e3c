#!/usr/bin/env bash
# After the review (0c4d7cf: the bench sets its first-page pointers from what was attached):
# the bench on the default shapes, with --first-pages off, page 1 and 1 kv head; every run checks
# its output against the float64 reference before and after timing.
set -uo pipefail
source kernels/bench/lib.sh .stage "$OUT"
bench on $b/pagedattn-bench --no-read-roofline
bench off $b/pagedattn-bench --first-pages off --cases "1,32768 16,4096" --no-read-roofline
bench p1 $b/pagedattn-bench --page-size 1 --cases "1,32768 16,4096" --no-read-roofline --reps 30
bench kv1 $b/pagedattn-bench --kv-heads 1 --cases "1,32768 8,4096" --no-read-roofline --reps 30
python3 kernels/bench/merge_rows.py "$tmp" "$out/decode.json" > /dev/null
python3 kernels/bench/rounds.py "$out/decode.json"
