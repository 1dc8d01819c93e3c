#!/usr/bin/env bash
set -uo pipefail
source kernels/bench/lib.sh .stage "$OUT"
nvidia-smi topo -m 2>&1 | head -12
lscpu | grep -i "numa\|model name\|socket\|mhz" | head
bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' | sed 's/^0000//')
echo "bus $bus"; ls /sys/bus/pci/devices/ | grep -i "${bus#0000}" | head -2
for d in /sys/bus/pci/devices/*${bus: -12}; do echo "$d"; cat $d/local_cpulist $d/numa_node 2>&1; done
cat /proc/cpuinfo | grep MHz | head -4
which numactl taskset
for r in 1 2 3; do
  for c in 0 2 4 6 8 10 12 14; do
    taskset -c $c "$b/pagedattn-bench" --cases "1,32768" --reps 200 --no-read-roofline --json $tmp/c${c}_r$r.json > /dev/null 2>&1 || echo fail $c
  done
done
python3 - $tmp <<'PY'
import json,sys,os,collections
g=collections.defaultdict(list)
for f in sorted(os.listdir(sys.argv[1])):
  r=json.load(open(os.path.join(sys.argv[1],f)))
  r=r[0] if isinstance(r,list) else r
  g[f.split('_')[0]].append((r['time_us'],r['b2b_time_us']))
for k,v in sorted(g.items(), key=lambda kv:int(kv[0][1:])): print(k, ' '.join(f"{a:.2f}/{b:.2f}" for a,b in v))
PY
