#!/usr/bin/env bash
set -uo pipefail
source .stage/env.sh
for i in 1 2; do
.stage/bin/pagedattn-bench --cases "1,32768" --exp 32 --reps 20 --no-read-roofline --json $OUT/tl$i.json > $OUT/tl$i.txt 2>&1
python3 - $OUT/tl$i.json.case0.csv <<'PY'
import csv,sys,statistics as st
rows=list(csv.DictReader(open(sys.argv[1])))
def q(col):
  v=sorted(int(r[col])/1000 for r in rows if int(r[col])>=0)
  return [round(v[int(f*(len(v)-1))],2) for f in (0,.25,.5,.75,1)]
for c in ['entry','params','item_or_lse_max','issued','first_tile','tiles_done']: print(c,q(c))
PY
done
