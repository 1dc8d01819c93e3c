# Shared by the script tests: wait for a started pagedattn-server and read its ports from
# its startup log lines. Callers define fail().

# The caller's PAGEDATTN_* variables (scripts/test.sh's PAGEDATTN_CMAKE_ARGS and
# PAGEDATTN_TEST_TORCH) would reach every server started here, as flags or as names it logs as
# ignored: each case sets the ones it means.
while read -r variable; do unset "$variable"; done < <(compgen -e | grep '^PAGEDATTN_')

# wait_started LOG PID: returns once the server has logged its full startup summary. Empty LOG
# before starting the server (`: >"$log"`): the server's own `>"$log"` truncates it only once
# its process runs, after this may have read an earlier server's summary there.
wait_started() {
  local log=$1 pid=$2
  for _ in $(seq 200); do
    grep -q "security: " "$log" && return 0
    kill -0 "$pid" 2>/dev/null || fail "server exited during start"
    sleep 0.05
  done
  fail "server did not finish starting"
}

# log_port LOG main|health|metrics: the port the server reported.
log_port() {
  case $2 in
    main) sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$1" | head -1 ;;
    health) sed -n 's/.*health port: \([0-9]*\).*/\1/p' "$1" | head -1 ;;
    metrics) sed -n 's/.*metrics: http port \([0-9]*\).*/\1/p' "$1" | head -1 ;;
  esac
}
