#!/usr/bin/env bash
# Container entrypoint: runs pagedattn-server with the container's arguments. The server itself
# reads PAGEDATTN_<FLAG> variables for its own flags only (PAGEDATTN_LOG_LEVEL=debug ->
# --log_level=debug), so variables Kubernetes injects (service links such as
# PAGEDATTN_METRICS_PORT=tcp://...) are ignored rather than turned into unknown flags.
set -euo pipefail
exec pagedattn-server "$@"
