#!/usr/bin/env bash
# Installs dependencies (scripts/install-deps.sh), configures and builds pagedattn.
#   scripts/build.sh [BUILD_DIR] [ninja targets...]
# The CUDA backend is built when nvcc is found (PATH or /usr/local/cuda), else CPU-only;
# CMake's output says which. Extra CMake options: PAGEDATTN_CMAKE_ARGS="-DPAGEDATTN_CUDA=OFF".
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
shift || true
scripts/install-deps.sh
mkdir -p "$build_dir"
# shellcheck disable=SC2086
if ! cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release ${PAGEDATTN_CMAKE_ARGS:-} \
    > "$build_dir/configure.log" 2>&1; then
  cat "$build_dir/configure.log"
  echo "build.sh: CMake configuration failed (log above, also in $build_dir/configure.log)" >&2
  exit 1
fi
grep "pagedattn:" "$build_dir/configure.log"  # says whether the CUDA backend is built
ninja -C "$build_dir" -j"$(nproc)" "$@"
