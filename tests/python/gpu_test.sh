#!/usr/bin/env bash
# The Python suite on the GPU machine (no network, no grpcio-tools): the wheel built here is
# unpacked into a private folder (a pure-Python wheel needs no pip), then tests/python runs
# against a CUDA-backend server that its fixture starts -- test_model.py included: the Llama in
# bfloat16 and float16 on the GPU, its KV cache in pagedattn, against transformers' attention.
#   here:  pip wheel --no-deps ./client/python -w .whl
#          pip download --only-binary=:all: --no-deps -d .whl pytest pluggy iniconfig   # if pytest is absent there
#          ../shared/device/stage.sh .stage build/server/pagedattn-server
#   there: bash tests/python/gpu_test.sh .stage .whl $OUT            (carry [".stage", ".whl"])
# Needs there: python3 with torch, transformers, grpcio, protobuf, numpy, ml_dtypes.
set -euo pipefail
stage=$1 wheels=$2 out=${3:-$(mktemp -d)}
source "$stage/env.sh"
site=$(mktemp -d)
unpack() { python3 -m zipfile -e "$1" "$site"; }
unpack "$(ls "$wheels"/pagedattn-*-py3-none-any.whl | tail -1)"
for m in pytest pluggy iniconfig; do
  python3 -c "import $m" 2>/dev/null && continue
  w=$(ls "$wheels"/"$m"-*.whl 2>/dev/null | tail -1) || true
  [ -n "$w" ] || { echo "gpu_test: $m is not installed and no $m wheel is in $wheels" >&2; exit 2; }
  unpack "$w"
done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1
python3 - <<'PY'
import grpc, google.protobuf, numpy, ml_dtypes, torch, transformers, pagedattn
print(f"python client on: grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}, "
      f"numpy {numpy.__version__}, torch {torch.__version__} (cuda {torch.cuda.is_available()}), "
      f"transformers {transformers.__version__}, pagedattn {pagedattn.__version__}")
PY
backend=${PAGEDATTN_BACKEND:-cuda}
PAGEDATTN_SERVER="$stage/bin/pagedattn-server" PAGEDATTN_BACKEND=$backend \
  python3 -m pytest tests/python -q -rs -s -p no:cacheprovider 2>&1 | tee "$out/pytest_$backend.log"
