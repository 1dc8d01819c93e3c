#!/usr/bin/env bash
# Proves the Docker images' steps without a Docker engine: `cmake --install` into a staging
# prefix (the layout the Dockerfiles copy from /opt/pagedattn), check every COPY source exists,
# then start the installed server through the installed entrypoint with environment variables
# (as the image does) and probe it with the installed CLI, then stop it with SIGTERM.
#   tests/scripts/install_layout_test.sh BUILD_DIR
set -euo pipefail
build=$(realpath "$1")
repo=$(cd "$(dirname "$0")/../.." && pwd)
stage=$(mktemp -d)
log=$(mktemp)
pid=""
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; rm -rf "$stage" "$log"' EXIT
fail() { echo "FAIL: $*"; [ -s "$log" ] && { echo "--- server log"; cat "$log"; }; exit 1; }
. "$(dirname "$0")/lib.sh"

# Install as the images do: the component their `cmake --install` names, and only the targets
# their ninja line builds may be in it (an install rule for a target not built stops the image's
# build: the images build on a fresh tree).
component=$(sed -n 's|.*cmake --install /build --prefix /opt/pagedattn --component \([a-z]*\).*|\1|p' \
  "$repo/docker/Dockerfile")
[ -n "$component" ] || fail "docker/Dockerfile's cmake --install names no --component"
cmake --install "$build" --prefix "$stage" --component "$component" > /dev/null
# The runtime stage's package list is produced by the same script in the build stage.
"$repo/scripts/install-deps.sh" --list-runtime > "$stage/share/pagedattn/runtime-packages.txt"
grep -q grpc "$stage/share/pagedattn/runtime-packages.txt" || fail "runtime package list has no gRPC"

for dockerfile in "$repo/docker/Dockerfile" "$repo/docker/Dockerfile.cpu"; do
  # COPY --from=build /opt/pagedattn/<path> <dest>: <path> must be in the installed layout.
  while read -r src; do
    [ -e "$stage/${src#/opt/pagedattn/}" ] || fail "$(basename "$dockerfile") copies $src, not installed"
  done < <(sed -n 's|^COPY --from=build \(/opt/pagedattn/[^ ]*\) .*|\1|p' "$dockerfile")
  # COPY <src> <dest> from the build context: <src> must be in the repository.
  while read -r src; do
    [ "$src" = "." ] || [ -e "$repo/$src" ] || fail "$(basename "$dockerfile") copies $src, not in the repo"
  done < <(grep '^COPY ' "$dockerfile" | grep -v -- '--from=' | awk '{print $2}')
  # Every RUN'd repo script exists and is executable.
  for s in $(grep -o 'scripts/[a-z-]*\.sh' "$dockerfile" | sort -u); do
    [ -x "$repo/$s" ] || fail "$(basename "$dockerfile") runs $s, not executable"
  done
  grep -q -- "cmake --install /build --prefix /opt/pagedattn --component $component " "$dockerfile" ||
    fail "$(basename "$dockerfile") does not install --component $component"
  built=" $(sed -n 's|.*ninja -C /build \([a-z -]*\).*|\1|p' "$dockerfile") "
  for f in "$stage"/bin/*; do
    head -c4 "$f" | grep -q ELF || continue  # a script (the entrypoint) is copied, not built
    [[ "$built" == *" $(basename "$f") "* ]] ||
      fail "$(basename "$dockerfile") installs $(basename "$f") but does not build it (builds:$built)"
  done
  grep -A1 '^HEALTHCHECK' "$dockerfile" | grep -q 'pagedattn-cli.*health' || fail "no CLI HEALTHCHECK in $dockerfile"
  grep -q '^USER pagedattn' "$dockerfile" || fail "$dockerfile does not drop root"
done
echo "install layout: every COPY source present"

# Start as the image does: entrypoint + env vars (ports 0: free ones), PATH from the layout.
PATH="$stage/bin:$PATH" PAGEDATTN_LISTEN=127.0.0.1:0 PAGEDATTN_HEALTH_LISTEN=127.0.0.1:0 \
  PAGEDATTN_METRICS_LISTEN=127.0.0.1:0 PAGEDATTN_BACKEND=cpu PAGEDATTN_LOG_LEVEL=debug \
  PAGEDATTN_TOKEN=not-a-flag PAGEDATTN_METRICS_PORT=tcp://10.0.0.1:9464 \
  PAGEDATTN_PAGEDATTN_SERVICE_HOST=10.0.0.1 "$stage/bin/pagedattn-entrypoint" --cpu_threads=1 \
  >"$log" 2>&1 &
pid=$!
wait_started "$log" $pid
# Kubernetes service-link variables are not flags: ignored (and named), not a crash loop.
grep -q "environment: PAGEDATTN_METRICS_PORT, PAGEDATTN_PAGEDATTN_SERVICE_HOST ignored" "$log" ||
  grep -q "environment: PAGEDATTN_PAGEDATTN_SERVICE_HOST, PAGEDATTN_METRICS_PORT ignored" "$log" ||
  fail "stray PAGEDATTN_* variables not reported as ignored"
hport=$(log_port "$log" health)
[ "$("$stage/bin/pagedattn-cli" --target=127.0.0.1:$hport health)" = SERVING ] || fail "health"
port=$(log_port "$log" main)
"$stage/bin/pagedattn-cli" --target=127.0.0.1:$port smoke | tail -1 | grep -qx PASS || fail "smoke"
grep -q "rpc Forward" "$log" || fail "PAGEDATTN_LOG_LEVEL=debug (read by the server itself) was not applied"
kill -TERM $pid
rc=0; wait $pid || rc=$?; pid=""
[ $rc -eq 0 ] || fail "exit code $rc after SIGTERM"
echo "install_layout_test: installed server ran from the staged layout and passed smoke"
