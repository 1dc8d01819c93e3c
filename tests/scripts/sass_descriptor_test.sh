#!/usr/bin/env bash
# The kernels' sm_90a SASS against a ptxas (CUDA 13.0) miscompile that only a GPU would otherwise
# find: a cp.async with an L2 policy addressed [R+UR] with its 64-bit memory descriptor in an odd
# uniform register (`desc[UR1]` beside `UR0`), an illegal instruction at run time. Every memory
# descriptor must be an even-aligned register pair (kernels/decode_kernel.cuh, the 16-bit copies).
#   sass_descriptor_test.sh BUILD_DIR
# cuobjdump and nvdisasm: from PATH, /usr/local/cuda/bin, or PyPI's nvidia-cuda-cuobjdump and
# nvidia-cuda-nvdisasm in BUILD_DIR/test-venv (scripts/test.sh installs them). Exit 77 (skip)
# without them or without sm_90a objects.
set -euo pipefail
build=$1
bins=$(find "$build/test-venv/" -type d -path '*nvidia/cu*/bin' 2>/dev/null | tr '\n' ':' || true)
export PATH="${bins}${PATH}:/usr/local/cuda/bin"
if ! command -v cuobjdump > /dev/null || ! command -v nvdisasm > /dev/null; then
  echo "SKIP: no cuobjdump and nvdisasm (scripts/test.sh installs them from PyPI)"
  exit 77
fi
mapfile -t objs < <(find "$build/kernels/" -name 'instantiate_*.cu.o' | sort)
checked=0
for o in "${objs[@]}"; do
  sass=$(cuobjdump -sass -arch sm_90a "$o" 2>/dev/null) || continue
  grep -q 'Function :' <<< "$sass" || continue
  checked=$((checked + 1))
  if bad=$(grep -E 'desc\[UR[0-9]*[13579]\]' <<< "$sass"); then
    echo "FAIL: $(basename "$o"): a memory descriptor in an odd uniform register:"
    head -3 <<< "$bad"
    exit 1
  fi
done
if [ "$checked" -eq 0 ]; then
  echo "SKIP: no sm_90a kernel objects under $build/kernels"
  exit 77
fi
echo "ok: $checked objects' sm_90a SASS, every memory descriptor an even register pair"
