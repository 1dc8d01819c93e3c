#!/usr/bin/env bash
# Builds pagedattn on a fresh machine and starts the server in the foreground.
#   scripts/run.sh [pagedattn-server flags...]      e.g. scripts/run.sh --listen=0.0.0.0:50051
# --backend=auto (the default) serves on the GPU when one is present, else on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh build pagedattn-server pagedattn-cli
# The build's variable, no flag of the server's: it would log it as an ignored PAGEDATTN_*.
unset PAGEDATTN_CMAKE_ARGS
exec build/server/pagedattn-server "$@"
