#!/bin/bash
# Fourteenth session, call 2: 1 x 32768 with a tile's splits as one 16-block cluster merged in
# distributed shared memory (--exp 512, 16 splits: --min-chunk 2048; 128 blocks), against the
# shipped plan (separate merge, 264 blocks) and the accumulating merge (--exp 128), four
# alternating rounds; then stamps of the cluster variant (--exp 544). carry [".stage"].
O=$1
source kernels/bench/lib.sh .stage "$O"
B=$b/pagedattn-bench
C="1,32768"
for r in 1 2 3 4; do
  bench ab/shipped_r$r $B --cases "$C"
  bench ab/cluster_r$r $B --cases "$C" --exp 512 --min-chunk 2048 --no-read-roofline
  bench ab/acc_r$r $B --cases "$C" --exp 128 --no-read-roofline
done
python3 kernels/bench/merge_rows.py "$tmp/ab" "$O/ab.json" > /dev/null
python3 kernels/bench/rounds.py "$O/ab.json"
$B --cases "$C" --exp 512 --min-chunk 2048 --reps 5 --no-read-roofline 2>&1 | grep -i cluster | head -3
$B --cases "$C" --exp 544 --min-chunk 2048 --reps 20 --no-read-roofline --json "$O/tl_cluster.json" > "$O/tl_cluster.txt" 2>&1
cut -c1-600 "$O/tl_cluster.txt" | head -8
