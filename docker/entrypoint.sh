#!/usr/bin/env bash
# Container entrypoint: every PAGEDATTN_<FLAG> environment variable becomes --<flag>=value
# for pagedattn-server (PAGEDATTN_LOG_LEVEL=debug -> --log_level=debug); arguments given to
# the container are appended. PAGEDATTN_TOKEN is the CLI's token and is not passed on.
set -euo pipefail
args=()
while IFS='=' read -r name value; do
  case "$name" in
    PAGEDATTN_TOKEN) continue ;;
    PAGEDATTN_*) flag=${name#PAGEDATTN_}; args+=("--${flag,,}=${value}") ;;
  esac
done < <(env)
exec pagedattn-server "${args[@]}" "$@"
