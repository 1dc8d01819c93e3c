#!/bin/bash
# Fourteenth session, call 1: the accumulating split merge (--exp 128) against the shipped
# (planned: separate merge) and the in-kernel merge, three alternating rounds; its own-partial
# path (--exp 384, every split writes a partial) for its error; then stamps of both in-kernel
# merges at 1 x 32768. carry [".stage"] (the bench only).
O=$1
source kernels/bench/lib.sh .stage "$O"
B=$b/pagedattn-bench
C="1,32768 16,4096"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.mem --format=csv,noheader
for r in 1 2 3; do
  bench ab/shipped_r$r $B --cases "$C"
  bench ab/inkernel_r$r $B --cases "$C" --merge in-kernel --no-read-roofline
  bench ab/acc_r$r $B --cases "$C" --exp 128 --no-read-roofline
done
bench ab/ownpart_r1 $B --cases "$C" --exp 384 --no-read-roofline
python3 kernels/bench/merge_rows.py "$tmp/ab" "$O/ab.json" > /dev/null
python3 kernels/bench/rounds.py "$O/ab.json"
python3 -c "
import json
for r in json.load(open('$O/ab.json')):
    if r.get('variant','').startswith('shipped'): print(r['variant'], r['batch'], r['ctx'], 'read_us', r.get('read_us'))"
$B --cases "1,32768" --exp 160 --reps 20 --no-read-roofline --json "$O/tl_acc.json" > "$O/tl_acc.txt" 2>&1
$B --cases "1,32768" --exp 32 --reps 20 --no-read-roofline --json "$O/tl_ship.json" > "$O/tl_ship.txt" 2>&1
cat "$O/tl_acc.txt" | cut -c1-700
echo ---
cat "$O/tl_ship.txt" | cut -c1-700
