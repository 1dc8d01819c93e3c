#!/bin/bash
# Fourteenth session, call 3: is 1 x 32768's per-launch time a property of the process, of the
# pool's allocation or of the stream (its cached graph)? Six processes, each timing the launch
# as usual and then on six fresh pool allocations and six fresh streams (--trials 6).
# carry [".stage"] (the bench only).
O=$1
source kernels/bench/lib.sh .stage "$O"
B=$b/pagedattn-bench
for r in 1 2 3 4 5 6; do
  "$B" --cases "1,32768" --trials 6 --no-read-roofline --json "$O/p$r.json" > "$O/p$r.txt" 2>&1
  echo "process $r: $(grep -o '"time_us": [0-9.]*' "$O/p$r.json") $(grep -o '"b2b_time_us": [0-9.]*' "$O/p$r.json")"
  grep '"trial"' "$O/p$r.txt"
done
