# Sourced by the GPU-machine scripts of kernels/bench, with the stage folder and the output
# folder as their first two arguments: sets stage, out, b (the staged binaries) and tmp (a fresh
# folder for the bench's JSON files), loads the stage's library path, and defines bench.
stage=$1
out=$2
b=$stage/bin
source "$stage/env.sh"
export PYTHONUNBUFFERED=1
tmp=$(mktemp -d)

# bench NAME BINARY [FLAGS...]: one pagedattn-bench run, its rows to $tmp/NAME.json (NAME may
# name a subfolder of $tmp); a failure is reported and the script goes on.
bench() {
  local name=$1 bin=$2
  shift 2
  mkdir -p "$(dirname "$tmp/$name")"
  timeout "${BENCH_TIMEOUT:-150}" "$bin" "$@" --json "$tmp/$name.json" > /dev/null ||
    echo "bench $name failed rc=$?"
}
