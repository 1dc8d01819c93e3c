#!/usr/bin/env bash
set -uo pipefail
source .stage/env.sh
for i in 1 2 3 4 5 6; do
  echo "process $i"
  .stage/bin/pagedattn-bench --cases "1,32768" --reps 200 --stream-probe 6 --no-read-roofline --json $OUT/p$i.json | grep -o '"stream_probe.*\|"time_us": [0-9.]*'
done
