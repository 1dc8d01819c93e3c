#!/bin/bash
# Call 11: the separate merge loading its splits in explicit batches of 5 (head_dim <= 128) or 3
# (one L2 round trip for the 33-split rows of 1 x 32768) against 2fd3815 (old, unroll by 4):
# the GPU tests of this build, then alternating rounds on the split shapes.
O=$1
mkdir -p .stage && tar xJf .stage-pack/stage.tar.xz -C .stage
source kernels/bench/lib.sh .stage $O
bash kernels/bench/run_tests.sh .stage $O
for r in 1 2 3 4; do
  bench old_r$r $b/pagedattn-bench-old --cases "1,32768 2,16384 16,4096" --reps 200 --no-read-roofline
  bench new_r$r $b/pagedattn-bench --cases "1,32768 2,16384 16,4096" --reps 200 --no-read-roofline
done
for r in 1 2; do
  for v in old new; do
    bin=$b/pagedattn-bench; [ $v = old ] && bin=$b/pagedattn-bench-old
    bench kv1_${v}_r$r $bin --kv-heads 1 --cases "1,32768 8,4096 1,131072" --no-read-roofline --reps 50
    bench kv2_${v}_r$r $bin --kv-heads 2 --cases "1,32768 2,16384" --no-read-roofline --reps 50
    bench kv4_${v}_r$r $bin --kv-heads 4 --cases "1,32768 2,16384" --no-read-roofline --reps 50
    bench d_${v}_r$r $bin --head-dim 256 --cases "1,32768" --no-read-roofline --reps 50
    bench d64_${v}_r$r $bin --head-dim 64 --cases "1,32768" --no-read-roofline --reps 50
  done
done
python3 kernels/bench/merge_rows.py $tmp $O/ab.json > /dev/null
python3 kernels/bench/rounds.py $O/ab.json
