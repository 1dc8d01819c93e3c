#!/usr/bin/env bash
# Decode diagnosis on the GPU machine: bench variants of one shape (split count, stages) and an
# Nsight Compute report of the decode kernel and of the plain read beside it.
#   there:  bash kernels/bench/probe_decode.sh .stage $OUT ["1,32768"]
set -uo pipefail
stage=$1
out=$2
shape=${3:-1,32768}
b=$stage/bin
source "$stage/env.sh"
{
  for v in "" "--blocks-scale 0.5" "--blocks-scale 2" "--blocks-scale 4" "--stages 2" "--stages 4" "--stages 5"; do
    echo "== $v"
    timeout 60 "$b/pagedattn-bench" --cases "$shape" $v --json /tmp/p.json > /dev/null
    python3 -c "import json;[print({k:r[k] for k in ('time_us','tbps','b2b_time_us','kv_chunk','blocks','read_us','read_tbps')}) for r in json.load(open('/tmp/p.json'))]"
  done
} > "$out/variants.log" 2>&1
cat "$out/variants.log"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for k in PagedAttentionTileKernel StreamRead; do
  timeout 150 "$ncu" --clock-control none --kernel-name regex:"$k" --launch-skip 4 --launch-count 1 \
    --set full --print-details all \
    "$b/pagedattn-bench" --cases "$shape" --warmup 3 --reps 3 --json /tmp/n.json > "$out/ncu_$k.txt" 2>&1
done
echo "ncu rc=$?"; grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued" "$out"/ncu_*.txt | head -30
