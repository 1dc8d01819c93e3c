#!/bin/bash
# Fourteenth session, call 5: the L2 flush before timing by reading a 4x-L2 buffer (clean lines
# left: the bench's default now) against writing it (dirty lines, call 4's flush) and against
# no flush, three alternating rounds; --trials 3 at 1 x 32768. carry [".stage"].
O=$1
source kernels/bench/lib.sh .stage "$O"
B=$b/pagedattn-bench
C="1,32768 256,2048 128,8192"
for r in 1 2 3; do
  bench ab/read_r$r $B --cases "$C" --no-read-roofline
  bench ab/dirty_r$r $B --cases "$C" --no-read-roofline --flush-l2-dirty
  bench ab/none_r$r $B --cases "$C" --no-read-roofline --no-flush-l2
done
bench ab/readroof_r1 $B --cases "$C"
python3 kernels/bench/merge_rows.py "$tmp/ab" "$O/ab.json" > /dev/null
python3 kernels/bench/rounds.py "$O/ab.json"
grep -o '"ctx": [0-9]*\|"read_us": [0-9.]*' "$tmp/ab/readroof_r1.json" | paste - -
"$B" --cases "1,32768" --trials 3 --no-read-roofline --json "$O/t1.json" 2>&1 | grep -E '"trial"'
