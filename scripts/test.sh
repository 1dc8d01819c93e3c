#!/usr/bin/env bash
# Builds pagedattn on a fresh machine and runs every test (ctest). GPU tests skip with a
# reason when no GPU is visible; all CUDA code still compiles when nvcc is present.
#   scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh build

# The grpcurl-style reflection check and the Prometheus parse check are Python (tooling from PyPI).
venv=build/test-venv
if [ ! -x "$venv/bin/python3" ] || ! "$venv/bin/python3" -c "import grpc_reflection, prometheus_client, yaml" 2>/dev/null; then
  python3 -m venv "$venv" && "$venv/bin/pip" install -q --disable-pip-version-check \
      grpcio grpcio-reflection protobuf prometheus-client pyyaml || {
    echo "test.sh: WARNING: could not set up $venv (no PyPI?): the reflection check will be skipped"
    rm -rf "$venv"
  }
fi
py=""
# Not realpath: the venv's python3 is a symlink to the base interpreter.
[ -x "$venv/bin/python3" ] && py="$PWD/$venv/bin/python3"
cmake -S . -B build -DPAGEDATTN_TEST_PYTHON="$py" > /dev/null
ctest --test-dir build --output-on-failure -j2
