#!/usr/bin/env bash
# The installed binaries as a user runs them: pagedattn-server on a free port, then
# pagedattn-cli health / info / validate / create-cache / smoke, then SIGTERM -> exit 0.
#   tests/scripts/server_cli_test.sh SERVER_BIN CLI_BIN [REFLECTION_CHECK_PYTHON]
set -euo pipefail
server=$1 cli=$2 py=${3:-}
log=$(mktemp); trap 'kill $pid 2>/dev/null || true; rm -f "$log"' EXIT
fail() { echo "FAIL: $*"; echo "--- server log"; cat "$log"; exit 1; }
. "$(dirname "$0")/lib.sh"

# A bad flag value stops the server at start with an error that names it.
out=$("$server" --listen=127.0.0.1:0 --backend=cpu --prefill_kernel=fastest 2>&1) && fail "bad --prefill_kernel accepted"
grep -q "prefill_kernel must be one of auto, portable (got 'fastest')" <<<"$out" || fail "bad --prefill_kernel: $out"

"$server" --listen=127.0.0.1:0 --backend=cpu --log_level=debug --metrics_listen=127.0.0.1:0 \
  --health_listen=127.0.0.1:0 >"$log" 2>&1 &
pid=$!
wait_started "$log" $pid
port=$(log_port "$log" main)
t="--target=127.0.0.1:$port"
echo "server up on port $port"

[ "$("$cli" $t health)" = "SERVING" ] || fail "health is not SERVING"
"$cli" $t info | grep -q '"backend": "cpu"' || fail "info does not say backend cpu"

# The issue's invalid config: four violations, named in one answer.
out=$("$cli" $t --page_size=0 --head_dim=100 --num_q_heads=32 --num_kv_heads=5 \
      --kv_dtype=DTYPE_UNSPECIFIED --num_pages=10 create-cache 2>&1) && fail "invalid config accepted"
for f in page_size head_dim num_q_heads kv_dtype "4 violations" INVALID_ARGUMENT; do
  grep -q "$f" <<<"$out" || fail "create-cache error does not mention $f: $out"
done
out=$("$cli" $t --num_pages=1000000000 create-cache 2>&1) && fail "oversized config accepted"
grep -q "RESOURCE_EXHAUSTED.*bytes are free" <<<"$out" || fail "oversized: $out"
"$cli" $t --num_layers=2 --num_pages=16 validate | grep -q '"valid": true' || fail "validate"

id=$("$cli" $t --num_layers=2 --num_pages=16 --name=cli-test create-cache | sed -n 's/.*"cacheId": "\([0-9a-f]*\)".*/\1/p')
[ -n "$id" ] || fail "create-cache printed no cacheId"
"$cli" $t list | grep -q "$id" || fail "list misses $id"
"$cli" $t describe "$id" | grep -q '"name": "cli-test"' || fail "describe"
"$cli" $t delete "$id" | grep -q "deleted $id" || fail "delete"
out=$("$cli" $t describe "$id" 2>&1) && fail "describe after delete succeeded"
grep -q NOT_FOUND <<<"$out" || fail "describe after delete: $out"

"$cli" $t smoke | tee /dev/stderr | tail -1 | grep -qx PASS || fail "smoke"

mport=$(log_port "$log" metrics)
hport=$(log_port "$log" health)
[ "$("$cli" --target=127.0.0.1:$hport health)" = "SERVING" ] || fail "health port"
stats=$("$cli" --metrics_target=127.0.0.1:$mport stats) || fail "stats"
grep -q 'pagedattn_rpcs_total{method="Forward",code="OK"} 4' <<<"$stats" || fail "stats: $stats"

if [ -n "$py" ]; then
  "$py" "$(dirname "$0")/reflection_check.py" "127.0.0.1:$port" || fail "reflection check"
  # /metrics must parse with the reference Prometheus parser.
  "$py" - "127.0.0.1:$mport" <<'PY' || fail "metrics do not parse as Prometheus text"
import sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
text = urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=10).read().decode()
names = [f.name for f in text_string_to_metric_families(text)]
assert "pagedattn_rpcs" in names and "pagedattn_forward_latency_seconds" in names, names
print("metrics parse: OK,", len(names), "families")
PY
fi

kill -TERM $pid
rc=0; wait $pid || rc=$?
[ $rc -eq 0 ] || fail "server exit code $rc after SIGTERM"
grep -q "received SIGTERM" "$log" || fail "no shutdown log line"
grep -q "rpc Forward cache=" "$log" || fail "no per-RPC debug line"
echo "server_cli_test: all checks passed"
