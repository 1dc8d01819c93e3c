#!/usr/bin/env bash
# The installed binaries as a user runs them: pagedattn-server on a free port, then
# pagedattn-cli health / info / validate / create-cache / smoke, then SIGTERM -> exit 0.
#   tests/scripts/server_cli_test.sh SERVER_BIN CLI_BIN [PYTHON]
# PYTHON (with prometheus-client): /metrics parsed by the reference Prometheus parser.
set -euo pipefail
server=$1 cli=$2 py=${3:-}
log=$(mktemp); trap 'kill $pid ${apid:-} 2>/dev/null || true; rm -f "$log" "$log".*' EXIT
fail() { echo "FAIL: $*"; echo "--- server log"; cat "$log"; exit 1; }
. "$(dirname "$0")/lib.sh"

# A bad flag value stops the server at start (exit 2) with an error that names it; every bad
# value at once.
pid=""
rc=0; out=$("$server" --listen=127.0.0.1:0 --backend=cpu --prefill_kernel=fastest 2>&1) || rc=$?
[ $rc -ne 0 ] || fail "bad --prefill_kernel accepted"
grep -q "prefill_kernel.*must be one of auto, portable" <<<"$out" || fail "bad --prefill_kernel: $out"
rc=0; out=$("$server" --listen=127.0.0.1:99999 --cpu_threads=-3 --max_message_mb=0 --request_memory_mb=3 \
  --shutdown_grace_s=-5 --max_total_pool_gb=-1 --metrics_listen=nohost --log_level=loud \
  --unix_socket_mode=0968 --backend=cpu --backend=cpu 2>&1) || rc=$?
[ $rc -eq 2 ] || fail "bad flags: exit $rc: $out"
for f in "--listen.*port is out of range" "--cpu_threads must be in 0..4096 (got -3)" \
         "--max_message_mb must be in 1..2047 (got 0)" "--shutdown_grace_s must be in 0..3600" \
         "--max_total_pool_gb must be in 0" "--metrics_listen must be host:port" \
         "--request_memory_mb must be 0 or at least 16 (got 3)" \
         "--log_level must be one of trace, debug, info, warn, error, off (any case; got 'loud')" \
         "--unix_socket_mode must be an octal file mode like 0660 (got '0968')" \
         "--backend is given 2 times"; do
  grep -q -- "$f" <<<"$out" || fail "bad flags: no '$f' in: $out"
done
# A pool budget too small to hold a page is refused, not rounded to 0 bytes (which means no limit).
rc=0; out=$("$server" --listen=127.0.0.1:0 --backend=cpu --max_total_pool_gb=1e-12 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q -- "--max_total_pool_gb must be 0 (no limit) or at least 1/1024 (1 MiB; got 1e-12)" <<<"$out" ||
  fail "tiny --max_total_pool_gb: exit $rc: $out"
# A value that does not parse and a name that is no flag are usage errors too (exit 2), all at
# once beside the values out of range (the flags library alone exits 1 on the first).
rc=0; out=$("$server" --listen=127.0.0.1:0 --max_message_mb=abc --graph_launch=maybe --backend gpu \
  --max_mesage_mb=5 --cpu_threads=-3 2>&1) || rc=$?
[ $rc -eq 2 ] || fail "unparsable flags: exit $rc: $out"
for f in "--max_message_mb must be an integer (got 'abc')" \
         "--graph_launch must be true or false (got 'maybe')" \
         "--backend must be one of auto, cuda, cpu (got 'gpu')" \
         "unknown flag --max_mesage_mb (see --help)" \
         "--cpu_threads must be in 0..4096 (got -3)"; do
  grep -q -- "$f" <<<"$out" || fail "unparsable flags: no '$f' in: $out"
done
# --help and --version take no value; a request budget beyond the host's memory holds nothing back.
rc=0; out=$("$server" --help=foo --version=1 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q -- "--help takes no value (--help alone)" <<<"$out" &&
  grep -q -- "--version takes no value" <<<"$out" || fail "--help=foo: exit $rc: $out"
rc=0; out=$("$server" --listen=127.0.0.1:0 --backend=cpu --request_memory_mb=16000000 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q -- "--request_memory_mb (16000000) is more than the host memory this process may use" <<<"$out" ||
  fail "--request_memory_mb past the host: exit $rc: $out"
# Half the host's memory for requests: the CPU backend keeps twice that from its pools, none left,
# which the start-up log says (a memory cgroup under half the host's refuses the flag instead).
half=$(( $(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo) / 2 + 16 ))
"$server" --listen=127.0.0.1:0 --backend=cpu --request_memory_mb=$half >"$log.mem" 2>&1 &
mpid=$!
for _ in $(seq 1200); do grep -q "security: " "$log.mem" && break; kill -0 $mpid 2>/dev/null || break; sleep 0.05; done
if kill -0 $mpid 2>/dev/null; then
  kill $mpid; wait $mpid || true
  grep -q "warning no host memory is left for pools: requests in flight keep 2 x $half MiB" "$log.mem" ||
    fail "no warning of pools without memory: $(cat "$log.mem")"
else
  wait $mpid || true
  grep -q -- "--request_memory_mb ($half) is more than the host memory" "$log.mem" ||
    fail "--request_memory_mb=$half: $(cat "$log.mem")"
fi
rc=0; out=$("$server" --listen=127.0.0.1:0 --backend 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q -- "--backend needs a value" <<<"$out" || fail "--backend alone: exit $rc: $out"
# The CLI alike: a value that does not parse or a name that is no flag is a usage error.
rc=0; out=$(timeout 10 "$cli" --target=127.0.0.1:1 --num_layers=abc --nmu_pages=4 validate 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q -- "--num_layers must be an integer (got 'abc')" <<<"$out" &&
  grep -q -- "unknown flag --nmu_pages (see --help)" <<<"$out" || fail "CLI bad flags: exit $rc: $out"
# A flag given twice is an error naming both values (absl alone keeps the last without a word);
# --listen given twice listens on both addresses, as its comma-separated list does.
rc=0; out=$(timeout 10 "$server" --listen=127.0.0.1:0 --backend=cpu --cpu_threads=1 --cpu_threads 2 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q -- "--cpu_threads is given 2 times (1, 2); give it once" <<<"$out" ||
  fail "a flag given twice: exit $rc: $out"
# The CLI too, a token's values left out of the message.
rc=0; out=$(timeout 10 "$cli" --target=127.0.0.1:1 --target 127.0.0.1:2 --token=s3cret-value-1 \
  --token=s3cret-value-2 health 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q -- "--target is given 2 times (127.0.0.1:1, 127.0.0.1:2)" <<<"$out" &&
  grep -q -- "--token is given 2 times; give it once" <<<"$out" && ! grep -q s3cret <<<"$out" ||
  fail "CLI flags given twice: exit $rc: $out"
# A deadline that is not a positive number of seconds is a usage error, not an RPC's failure.
for t in 0 -1 nan inf; do
  rc=0; out=$(timeout 10 "$cli" --target=127.0.0.1:1 --timeout_s=$t health 2>&1) || rc=$?
  [ $rc -eq 2 ] && grep -q -- "--timeout_s must be a positive number of seconds" <<<"$out" ||
    fail "--timeout_s=$t: exit $rc: $out"
done
# A token with a line end (as read from a secret file) is refused before any call, unquoted;
# gRPC aborted the process on it and printed the token.
rc=0; out=$(PAGEDATTN_TOKEN=$'s3cret-line-token\n' timeout 10 "$cli" --target=127.0.0.1:1 health 2>&1) || rc=$?
[ $rc -ne 0 ] && [ $rc -lt 128 ] && grep -q "byte 0x0a at position 17 of 18.*strip it" <<<"$out" &&
  ! grep -q s3cret <<<"$out" || fail "token with a newline: exit $rc: $out"
sockdir=$(mktemp -d)
: >"$log"  # wait_started must not read the last server's lines (lib.sh)
"$server" --listen=127.0.0.1:0 --listen "unix:$sockdir/pa.sock" --unix_socket_mode=0600 \
  --backend=cpu >"$log" 2>&1 &
pid=$!
wait_started "$log" $pid
grep -q -- "--listen=127.0.0.1:0,unix:$sockdir/pa.sock" "$log" || fail "--listen twice: $(head -1 "$log")"
mode=$(stat -c %a "$sockdir/pa.sock")
[ "$mode" = 600 ] || fail "--unix_socket_mode=0600: the socket's mode is $mode"
[ "$("$cli" --target="unix:$sockdir/pa.sock" health)" = "SERVING" ] || fail "--listen twice: socket"
[ "$("$cli" --target="127.0.0.1:$(log_port "$log" main)" health)" = "SERVING" ] ||
  fail "--listen twice: port"
kill -TERM $pid; wait $pid || fail "server with two --listen exit code $?"
rm -rf "$sockdir"

# ":port" (every interface), as --help offers it, on each gRPC listener: gRPC cannot parse an
# empty host itself.
: >"$log"
"$server" --listen=:0 --health_listen=:0 --backend=cpu >"$log" 2>&1 &
pid=$!
wait_started "$log" $pid
[ "$("$cli" --target="127.0.0.1:$(log_port "$log" main)" health)" = "SERVING" ] ||
  fail "--listen=:0: main port"
[ "$("$cli" --target="127.0.0.1:$(log_port "$log" health)" health)" = "SERVING" ] ||
  fail "--health_listen=:0: health port"
kill -TERM $pid; wait $pid || fail "server on :0 exit code $?"

# A misspelled flag variable is a warning naming the variable it is likely a typo of (here the
# operator meant to turn auth on); an unrelated PAGEDATTN_ variable stays an info line. The limits
# in force, from a ConfigMap's variables as from flags, are in the start-up log.
: >"$log"
PAGEDATTN_AUTH_TOKEN_FILE=/nonexistent PAGEDATTN_SOMETHING_ELSE=1 PAGEDATTN_MAX_CACHES_PER_TENANT=7 \
  PAGEDATTN_MAX_FORWARD_TOKENS=4096 PAGEDATTN_CACHE_IDLE_TIMEOUT_S=1 "$server" \
  --listen=127.0.0.1:0 --backend=cpu --max_forward_spans=33 >"$log" 2>&1 &
pid=$!
wait_started "$log" $pid
grep -q "info limits: .*; 7 caches per tenant, deleted once unused for 1 s (--cache_idle_timeout_s); a Forward of up to 4096 tokens and 33 spans;" "$log" ||
  fail "the limits line: $(grep limits "$log")"
# A cache no call comes to for --cache_idle_timeout_s is deleted, and the log says why (its name
# escaped, as in the line that created it: a quote in it cannot end the quoted name).
t="--target=127.0.0.1:$(log_port "$log" main)"
id=$("$cli" $t --num_pages=16 --name="left-behind') tenant=(x" create-cache |
  sed -n 's/.*"cacheId": "\([0-9a-f]*\)".*/\1/p')
[ -n "$id" ] || fail "create-cache for the idle timeout"
sleep 0.3  # time passing: describe tells how long the cache has gone unused
out=$("$cli" $t describe "$id") || fail "describe: $out"
idle=$(sed -n 's/.*"idleMs": "\([0-9]*\)".*/\1/p' <<<"$out")
[ -n "$idle" ] && [ "$idle" -ge 300 ] || fail "describe's idleMs after 0.3 s: $out"
for _ in $(seq 100); do
  "$cli" $t list | grep -q "$id" || break
  sleep 0.1
done
! "$cli" $t list | grep -q "$id" || fail "a cache unused past --cache_idle_timeout_s=1 is still listed"
grep -q "warning deleted cache $id ('left-behind\\\\x27) tenant=(x'): unused for [0-9]* s, past --cache_idle_timeout_s=1 (no Forward, release or truncate); [0-9]* bytes freed" "$log" ||
  fail "the idle cache's line: $(grep "deleted cache" "$log")"
out=$("$cli" $t describe "$id" 2>&1) && fail "describe of an idle-deleted cache: $out"
grep -q "NOT_FOUND: cache '$id' was deleted by the server after [0-9]* s unused (its --cache_idle_timeout_s): create the cache again" <<<"$out" ||
  fail "describe of an idle-deleted cache: $out"
grep -q "warning environment: PAGEDATTN_AUTH_TOKEN_FILE ignored (no such flag): did you mean PAGEDATTN_AUTH_TOKENS_FILE?" "$log" ||
  fail "a misspelled variable: $(grep environment "$log")"
grep -q "info environment: PAGEDATTN_SOMETHING_ELSE ignored" "$log" ||
  fail "an unrelated variable: $(grep environment "$log")"
kill -TERM $pid; wait $pid || fail "server exit code $?"

# --backend=auto with no GPU visible (CUDA_VISIBLE_DEVICES= hides every one): the CPU backend and,
# in a build with CUDA, a warning that says why; --backend=cuda refuses to start, saying why.
: >"$log"
CUDA_VISIBLE_DEVICES= "$server" --listen=127.0.0.1:0 --backend=auto >"$log" 2>&1 &
pid=$!
wait_started "$log" $pid
grep -q "backend cpu on" "$log" || fail "auto without a GPU: not on the CPU backend"
if grep -q "build has CUDA: yes" "$log"; then
  grep -q 'serving on the CPU backend because.*no CUDA GPU is visible.*CUDA_VISIBLE_DEVICES=""' \
    "$log" || fail "auto without a GPU: no warning that says why"
  rc=0; out=$(CUDA_VISIBLE_DEVICES= timeout 10 "$server" --listen=127.0.0.1:0 --backend=cuda 2>&1) ||
    rc=$?
  [ $rc -ne 0 ] && grep -q -- "--backend=cuda but no CUDA GPU is visible" <<<"$out" ||
    fail "--backend=cuda without a GPU: exit $rc: $out"
else
  ! grep -q "serving on the CPU backend because" "$log" || fail "a build without CUDA warns of it"
fi
kill -TERM $pid; wait $pid || fail "auto without a GPU: exit code $?"

# --help: exit 0, every flag with its default, no path of the build machine.
out=$("$server" --help) || fail "--help exit code $?"
grep -q -- "--shutdown_grace_s (default: 10)" <<<"$out" || fail "--help: $out"
grep -q -- "PAGEDATTN_<FLAG>" <<<"$out" || fail "--help does not explain PAGEDATTN_<FLAG>"
! grep -q "main.cc\|/work/\|/src/" <<<"$out" || fail "--help shows a build path: $out"
"$server" --version | grep -q "^pagedattn-server [0-9]" || fail "--version"
# A word a command would ignore is an error (exit 2), not dropped.
for cmd in "health extra" "describe id extra"; do
  rc=0; out=$("$cli" --target=127.0.0.1:1 $cmd 2>&1) || rc=$?
  [ $rc -eq 2 ] && grep -q "unexpected argument 'extra'" <<<"$out" || fail "$cmd: exit $rc: $out"
done
# A target or TLS flags the client refuses are usage errors (exit 2, not 1), nothing sent.
for args in "--target=localhost:99999 info" "--target= info" \
    "--target=127.0.0.1:1 --tls_server_name=x info"; do
  rc=0; out=$("$cli" $args 2>&1) || rc=$?
  [ $rc -eq 2 ] && grep -q "^pagedattn-cli: " <<<"$out" || fail "cli $args: exit $rc: $out"
done
# A request id gRPC cannot send (it would abort the process) is a usage error, nothing sent.
rc=0; out=$("$cli" --target=127.0.0.1:1 --request_id=$'step\nforged' info 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q -- "--request_id: byte 0x0a at position 4 of 11" <<<"$out" ||
  fail "bad --request_id: exit $rc: $out"
# Two of the server's own listeners on one port are named as such (not "in use by another
# process", which it is not).
rc=0; out=$("$server" --backend=cpu --listen=0.0.0.0:50551 --health_listen=127.0.0.1:50551 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q -- "--health_listen and --listen both take port 50551" <<<"$out" ||
  fail "shared port: exit $rc: $out"
# A bad value from the environment is named by its variable too (a container sets no flags);
# the command line's own value is named by the flag alone.
rc=0; out=$(PAGEDATTN_MAX_MESSAGE_MB=0 "$server" --backend=cpu --listen=127.0.0.1:0 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q -- "--max_message_mb must be in 1..2047 (got 0) (set by PAGEDATTN_MAX_MESSAGE_MB)" <<<"$out" ||
  fail "env range error: exit $rc: $out"
rc=0; out=$(PAGEDATTN_MAX_MESSAGE_MB=0 "$server" --backend=cpu --listen=127.0.0.1:0 --max_message_mb=0 2>&1) || rc=$?
[ $rc -eq 2 ] && ! grep -q "set by" <<<"$out" || fail "command-line range error: exit $rc: $out"
# So is one the server cannot start with (a file it cannot read, a port it cannot take).
rc=0; out=$(PAGEDATTN_AUTH_TOKENS_FILE=/nonexistent/tokens PAGEDATTN_TLS_KEY= "$server" --backend=cpu \
  --listen=127.0.0.1:0 2>&1) || rc=$?
[ $rc -eq 1 ] && grep -q -- "--auth_tokens_file /nonexistent/tokens: cannot read the file .* (set by PAGEDATTN_AUTH_TOKENS_FILE)$" <<<"$out" ||
  fail "env start error: exit $rc: $out"
# --log_level=off silences the log, not the reason the process exits at once.
rc=0; out=$("$server" --backend=cpu --listen=127.0.0.1:0 --log_level=off \
  --auth_tokens_file=/nonexistent/tokens 2>&1) || rc=$?
[ $rc -eq 1 ] && grep -q -- "cannot start: .*--auth_tokens_file /nonexistent/tokens: cannot read" <<<"$out" ||
  fail "start error at --log_level=off: exit $rc: $out"
printf 'short-token tenant\n' >"$log.tokens"
rc=0; out=$(PAGEDATTN_AUTH_TOKENS_FILE="$log.tokens" "$server" --backend=cpu --listen=127.0.0.1:0 2>&1) || rc=$?
rm -f "$log.tokens"
[ $rc -eq 1 ] && grep -q -- "--auth_tokens_file $log.tokens: line 1: a token must be at least 16 characters .* (set by PAGEDATTN_AUTH_TOKENS_FILE)$" <<<"$out" ||
  fail "env tokens file error: exit $rc: $out"
rc=0; out=$(PAGEDATTN_TLS_CERT=/nonexistent/server.pem "$server" --backend=cpu --listen=127.0.0.1:0 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q -- "--tls_cert and --tls_key must be given together (set by PAGEDATTN_TLS_CERT)$" <<<"$out" ||
  fail "env TLS flag error: exit $rc: $out"
# TLS's files that come in pairs are flag errors too, all at once beside the others; whole
# numbers are given as integers, as --help gives them.
rc=0; out=$("$server" --backend=cpu --listen=127.0.0.1:0 --tls_client_ca=/nonexistent/ca.pem \
  --max_message_mb=0 --cache_idle_timeout_s=-1 --max_forward_spans=0 2>&1) || rc=$?
[ $rc -eq 2 ] || fail "TLS pairing: exit $rc: $out"
for f in "--tls_client_ca needs --tls_cert and --tls_key" "--max_message_mb must be in 1..2047 (got 0)" \
         "--cache_idle_timeout_s must be in 0..31536000 (got -1)" \
         "--max_forward_spans must be in 1..1000000000 (got 0)"; do
  grep -q -- "$f" <<<"$out" || fail "TLS pairing: no '$f' in: $out"
done
# The CLI's --help too: exit 0, its commands and every flag with its default (never a flag's
# value: --token's is a secret), no path of the build machine; --version its version.
out=$("$cli" --token=s3cret-help-value --help) || fail "cli --help exit code $?"
grep -q -- "--num_pages (default: 0)" <<<"$out" && grep -q "cache config: pages" <<<"$out" &&
  grep -q "release CACHE_ID SEQ" <<<"$out" && grep -q -- "--request_id (default: )" <<<"$out" ||
  fail "cli --help: $out"
! grep -q "cli.cc\|/work/\|/src/" <<<"$out" || fail "cli --help shows a build path: $out"
! grep -q "s3cret-help-value" <<<"$out" || fail "cli --help shows --token's value"
out=$("$cli" --version) || fail "cli --version exit code $?"
grep -q "^pagedattn-cli [0-9]" <<<"$out" || fail "cli --version: $out"
# The load generator's too (it is installed beside the CLI).
loadgen=$(dirname "$cli")/pagedattn-loadgen
out=$("$loadgen" --help) || fail "loadgen --help exit code $?: $out"
grep -q -- "--cases (default: 64x4096,16x4096,1x4096)" <<<"$out" &&
  grep -q -- "--shard_targets (default: )" <<<"$out" || fail "loadgen --help: $out"
! grep -q "loadgen.cc\|/work/\|/src/" <<<"$out" || fail "loadgen --help shows a build path: $out"
"$loadgen" --version | grep -q "^pagedattn-loadgen [0-9]" || fail "loadgen --version"
# A target the client refuses is a usage error naming the flag, not an abort.
rc=0; out=$("$loadgen" --target=127.0.0.1:99999 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q -- "--target: INVALID_ARGUMENT: target '127.0.0.1:99999'" <<<"$out" ||
  fail "loadgen --target=127.0.0.1:99999: exit $rc: $out"
rc=0; out=$("$loadgen" --layers=x --modez=unary 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q -- "--layers must be an integer (got 'x')" <<<"$out" &&
  grep -q -- "unknown flag --modez (see --help)" <<<"$out" || fail "loadgen bad flags: exit $rc: $out"
# Values no run could use, each named before anything runs (--dtype was sent unparsed, 0 steps
# made up rows, -1x5 aborted, an unwritable --json was dropped silently).
rc=0; out=$("$loadgen" --target=127.0.0.1:1 --dtype=garbage --steps=0 --warmup=-5 \
  --json=/nonexistent/x.json --uds_target=/tmp/s 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q -- "--dtype must be BFLOAT16 or FLOAT16 (got 'garbage')" <<<"$out" &&
  grep -q -- "--steps must be >= 1 (got 0)" <<<"$out" && grep -q -- "--warmup must be >= 0" <<<"$out" &&
  grep -q -- "--json: cannot write '/nonexistent/x.json'" <<<"$out" &&
  grep -q -- "--uds_target must be unix:/path" <<<"$out" || fail "loadgen bad values: exit $rc: $out"
# UDS modes alone without --uds_target: an error, not an empty result.
rc=0; out=$("$loadgen" --target=127.0.0.1:1 --modes=unary_uds,stream_uds 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q "modes unary_uds, stream_uds need --uds_target" <<<"$out" ||
  fail "loadgen UDS modes without --uds_target: exit $rc: $out"
for bad in "--cases=-1x5" "--cases=," "extra"; do
  rc=0; out=$("$loadgen" --target=127.0.0.1:1 "$bad" 2>&1) || rc=$?
  [ $rc -eq 2 ] && grep -q "^pagedattn-loadgen: " <<<"$out" || fail "loadgen $bad: exit $rc: $out"
done

: >"$log"
"$server" --listen=127.0.0.1:0 --backend=cpu --log_level=debug --metrics_listen=127.0.0.1:0 \
  --health_listen=127.0.0.1:0 >"$log" 2>&1 &
pid=$!
wait_started "$log" $pid
port=$(log_port "$log" main)
t="--target=127.0.0.1:$port"
echo "server up on port $port"

# A second server on a busy port fails to start, and says so (no SO_REUSEPORT: it would take
# half of the first one's connections). Same for the health port.
hport=$(log_port "$log" health)
# Where the probe and scrape ports are bound, not only their numbers.
grep -q "health port: $hport on 127.0.0.1; metrics: http port [0-9]* on 127.0.0.1 /metrics" "$log" ||
  fail "no bound addresses: $(grep "security: " "$log")"
rc=0; out=$("$server" --listen=127.0.0.1:$port --backend=cpu 2>&1) || rc=$?
[ $rc -eq 1 ] || fail "second server on busy port $port: exit $rc: $out"
grep -q "could not listen on --listen=127.0.0.1:$port (in use" <<<"$out" || fail "busy port: $out"
# Of several addresses, the busy one is named (not the first).
rc=0; out=$("$server" --listen=127.0.0.1:0,127.0.0.1:$port --backend=cpu 2>&1) || rc=$?
[ $rc -eq 1 ] && grep -q "could not listen on --listen=127.0.0.1:$port (in use" <<<"$out" ||
  fail "busy second address: exit $rc: $out"
rc=0; out=$("$server" --listen=127.0.0.1:0 --health_listen=127.0.0.1:$hport --backend=cpu 2>&1) || rc=$?
[ $rc -eq 1 ] || fail "second server on busy health port: exit $rc: $out"
grep -q "could not listen on --health_listen" <<<"$out" || fail "busy health port: $out"
# The metrics port too; a server that never served logs no drain before its error.
mport=$(log_port "$log" metrics)
rc=0; out=$("$server" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:$mport --backend=cpu 2>&1) || rc=$?
[ $rc -eq 1 ] && grep -q -- "--metrics_listen 127.0.0.1:$mport: cannot listen" <<<"$out" ||
  fail "second server on busy metrics port: exit $rc: $out"
! grep -q "drain" <<<"$out" || fail "a server that did not start logs a drain: $out"

[ "$("$cli" $t health)" = "SERVING" ] || fail "health is not SERVING"
"$cli" $t info | grep -q '"backend": "cpu"' || fail "info does not say backend cpu"
# The CLI's own words: `help` is its usage, a bad sequence id a usage error in its name, and a
# failed call says what to try where its code alone tells it.
out=$("$cli" help) && grep -q "release CACHE_ID SEQ" <<<"$out" || fail "cli help: $out"
rc=0; out=$("$cli" $t release some-cache x 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q "^pagedattn-cli: release: not a sequence id: 'x'" <<<"$out" ||
  fail "release x: exit $rc: $out"
rc=0; out=$("$cli" $t --num_pages=9 --service=x --metrics_target=x:1 list 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q -- "^pagedattn-cli: --num_pages is for validate, create-cache, smoke, not list; --service is for health, not list$" <<<"$out" ||
  fail "flags list does not read: exit $rc: $out"
rc=0; out=$("$cli" --metrics_target=127.0.0.1:1 stats 2>&1) || rc=$?
[ $rc -eq 1 ] && grep -q "^hint: stats reads --metrics_target=127.0.0.1:1 over plain HTTP" <<<"$out" ||
  fail "stats of no metrics port: exit $rc: $out"
rc=0; out=$("$cli" $t frobnicate 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q "^pagedattn-cli: unknown command 'frobnicate'" <<<"$out" ||
  fail "unknown command: exit $rc: $out"
rc=0; out=$(timeout 20 "$cli" --target=127.0.0.1:1 --timeout_s=3 health 2>&1) || rc=$?
[ $rc -eq 1 ] && grep -q "^error: UNAVAILABLE" <<<"$out" &&
  grep -q "^hint: no answer from --target=127.0.0.1:1: .* give its CA with --tls_ca" <<<"$out" ||
  fail "no server: exit $rc: $out"
rc=0; out=$(timeout 20 "$cli" --target=127.0.0.1 --timeout_s=3 health 2>&1) || rc=$?
[ $rc -eq 1 ] && grep -q "^hint: no answer from --target=127.0.0.1: .* It names no port, so gRPC connects to 443" <<<"$out" ||
  fail "no port: exit $rc: $out"
printf 'cli-hint-token-0123456789 team-a\n' >"$log.tokens"
"$server" --listen=127.0.0.1:0 --backend=cpu --auth_tokens_file="$log.tokens" >"$log.auth" 2>&1 &
apid=$!
wait_started "$log.auth" $apid
at="--target=127.0.0.1:$(log_port "$log.auth" main)"
rc=0; out=$("$cli" $at list 2>&1) || rc=$?
[ $rc -eq 1 ] && grep -q "^hint: the server takes bearer tokens: give yours with --token or PAGEDATTN_TOKEN" <<<"$out" ||
  fail "no token: exit $rc: $out"
rc=0; out=$("$cli" $at --token=cli-hint-token-9999999999 list 2>&1) || rc=$?
[ $rc -eq 1 ] && grep -q "^hint: the token given .* is not in the server's --auth_tokens_file" <<<"$out" ||
  fail "wrong token: exit $rc: $out"
PAGEDATTN_TOKEN=cli-hint-token-0123456789 "$cli" $at list >/dev/null || fail "the right token"
kill $apid; wait $apid || true
rm -f "$log.tokens" "$log.auth"

# The issue's invalid config: four violations, named in one answer.
out=$("$cli" $t --page_size=0 --head_dim=100 --num_q_heads=32 --num_kv_heads=5 \
      --num_pages=10 create-cache 2>&1) && fail "invalid config accepted"
for f in page_size head_dim num_q_heads "3 violations" INVALID_ARGUMENT; do
  grep -q "$f" <<<"$out" || fail "create-cache error does not mention $f: $out"
done
# Violations past the server's 1 KiB message: the CLI says where to read them all.
out=$("$cli" $t --num_layers=4 --num_q_heads=0 --head_dim=100 --page_size=0 --layers='[{"slidingWindow":-1,"logitSoftcap":-2,"sinks":[1]},{"slidingWindow":-5,"logitSoftcap":-3,"sinks":[1,2]},{"slidingWindow":-7},{"logitSoftcap":-9}]' \
      --num_pages=10 create-cache 2>&1) && fail "invalid config accepted"
grep -q "(11 violations).* bytes)$" <<<"$out" && grep -q "^hint: .*validate.* lists every violation" <<<"$out" ||
  fail "a cut message without the validate hint: $out"
out=$("$cli" $t --num_pages=16000000 create-cache 2>&1) && fail "oversized config accepted"
grep -q "RESOURCE_EXHAUSTED.*bytes are free" <<<"$out" || fail "oversized: $out"
"$cli" $t --num_layers=2 --num_pages=16 validate | grep -q '"valid": true' || fail "validate"
# The dry run says why a pool does not fit, as CreateCache would.
rc=0; out=$("$cli" $t --num_pages=16000000 validate 2>&1) || rc=$?
[ $rc -eq 1 ] || fail "validate of an oversized pool: exit $rc"
grep -q '"field": "num_pages"' <<<"$out" && grep -q "bytes are free" <<<"$out" || fail "validate oversized: $out"
# CLI config flags: case-insensitive dtypes, UNSPECIFIED not offered, conflicting capacity.
"$cli" $t --num_layers=2 --num_pages=16 --kv_dtype=bfloat16 validate | grep -q '"valid": true' || fail "lower-case dtype"
rc=0; out=$("$cli" $t --kv_dtype=int8 validate 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q "FLOAT16, BFLOAT16, FLOAT32 or FLOAT8_E4M3" <<<"$out" && ! grep -q UNSPECIFIED <<<"$out" || fail "bad --kv_dtype: $out"
rc=0; out=$("$cli" $t --num_pages=16 --max_bytes=100000 validate 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q "not both" <<<"$out" || fail "num_pages and max_bytes: $out"
# A negative capacity is the server's violation to name, never the default capacity.
for f in num_pages max_bytes; do
  rc=0; out=$("$cli" $t --$f=-1 validate 2>&1) || rc=$?
  [ $rc -eq 1 ] && grep -q "\"field\": \"$f\"" <<<"$out" || fail "--$f=-1: exit $rc: $out"
done
# An FP8 cache's scaling: STATIC with its scales (echoed per layer), bad values named.
"$cli" $t --num_layers=2 --num_pages=16 --kv_dtype=float8_e4m3 --kv_scaling=static \
  --kv_scales=0.02,0.01 validate | grep -q '"valid": true' || fail "FP8 STATIC with scales"
rc=0; out=$("$cli" $t --kv_dtype=float8_e4m3 --kv_scaling=static --num_pages=16 validate 2>&1) || rc=$?
[ $rc -eq 1 ] && grep -q '"field": "kv_scales"' <<<"$out" || fail "FP8 STATIC without scales: exit $rc $out"
rc=0; out=$("$cli" $t --kv_scaling=bogus validate 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q "PER_TOKEN or STATIC" <<<"$out" || fail "bad --kv_scaling: exit $rc $out"
# --layers: a Gemma-style table (windowed and global layers, soft-capped) validates and is echoed;
# a bad entry is the server's field violation, JSON that is not one a usage error.
out=$("$cli" $t --num_layers=2 --num_pages=16 \
  --layers='[{"slidingWindow": 4096, "logitSoftcap": 50}, {"logitSoftcap": 50}]' validate) || fail "--layers: $out"
grep -q '"slidingWindow": 4096' <<<"$out" && grep -q '"valid": true' <<<"$out" || fail "--layers not sent: $out"
rc=0; out=$("$cli" $t --num_layers=2 --num_pages=16 --layers='[{"slidingWindow": 0}]' validate 2>&1) || rc=$?
[ $rc -eq 1 ] && grep -q '"field": "layers\[0\].sliding_window"' <<<"$out" || fail "--layers window 0: exit $rc $out"
rc=0; out=$("$cli" $t --layers='[{"window": 1}]' validate 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q "JSON array of LayerAttention" <<<"$out" || fail "--layers bad JSON: exit $rc $out"
# A scale float cannot carry is refused as typed (it would reach the server as 0 or inf).
rc=0; out=$("$cli" $t --kv_dtype=float8_e4m3 --kv_scaling=static --kv_scales=1e-50,1 validate 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q "'1e-50' is outside float's range" <<<"$out" || fail "--kv_scales=1e-50: exit $rc $out"

id=$("$cli" $t --num_layers=2 --num_pages=16 --name=cli-test create-cache | sed -n 's/.*"cacheId": "\([0-9a-f]*\)".*/\1/p')
[ -n "$id" ] || fail "create-cache printed no cacheId"
"$cli" $t list | grep -q "$id" || fail "list misses $id"
"$cli" $t describe "$id" | grep -q '"name": "cli-test"' || fail "describe"
"$cli" $t delete "$id" | grep -q "deleted $id" || fail "delete"
out=$("$cli" $t describe "$id" 2>&1) && fail "describe after delete succeeded"
grep -q NOT_FOUND <<<"$out" || fail "describe after delete: $out"
# --request_id: every call of the command carries it (the server's lines, checked at the end).
out=$("$cli" $t --request_id=cli-req-7 describe "$id" 2>&1) && fail "describe of a deleted cache succeeded"
grep -q NOT_FOUND <<<"$out" || fail "describe with --request_id: $out"
"$cli" $t --request_id=cli-req-8 list >/dev/null || fail "list with --request_id"

"$cli" $t smoke | tee /dev/stderr | tail -1 | grep -qx PASS || fail "smoke"
# smoke runs the config the flags give, and deletes its cache whatever happens.
"$cli" $t --head_dim=64 --page_size=7 --num_q_heads=8 --num_kv_heads=2 --kv_dtype=FLOAT16 smoke \
  > "$log.smoke" || fail "smoke with flags: $(cat "$log.smoke")"
grep -q "head_dim 64, page_size 7" "$log.smoke" || fail "smoke ignores its flags: $(cat "$log.smoke")"
# An FP8 STATIC smoke runs STATIC (not PER_TOKEN), and flags it cannot use are refused.
"$cli" $t --head_dim=64 --kv_dtype=FLOAT8_E4M3 --kv_scaling=STATIC --kv_scales=0.02,0.01 smoke \
  > "$log.smoke" || fail "FP8 STATIC smoke: $(cat "$log.smoke")"
grep -q "kv_dtype FLOAT8_E4M3 (STATIC)" "$log.smoke" || fail "smoke ignores --kv_scaling: $(cat "$log.smoke")"
# --layers' variants reach the smoke's cache and its reference (a window shorter than its
# sequences, a soft-cap, sinks); a layer count or capacity for smoke is refused, not dropped.
"$cli" $t --head_dim=64 --num_q_heads=8 --num_kv_heads=2 \
  --layers='[{"slidingWindow": 7, "logitSoftcap": 5, "sinks": [0,1,2,3,-1,-2,0.5,1.5]}, {}]' \
  smoke > "$log.smoke" || fail "smoke with --layers: $(cat "$log.smoke")"
grep -q "layer 0: window 7, soft-cap 5, 8 sinks" "$log.smoke" && grep -q "layer 1: plain" "$log.smoke" ||
  fail "smoke ignores --layers: $(cat "$log.smoke")"
for bad in --num_layers=4 --num_pages=99 --max_bytes=1000000; do
  rc=0; out=$("$cli" $t "$bad" smoke 2>&1) || rc=$?
  [ $rc -eq 2 ] && grep -q "smoke makes its own cache.*${bad%%=*} is validate's" <<<"$out" ||
    fail "smoke $bad: exit $rc $out"
done
rc=0; out=$("$cli" $t --layers='[{}, {}, {}]' smoke 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q "the smoke cache has 2 layers" <<<"$out" || fail "smoke of 3 layers: exit $rc $out"
# --device reaches the smoke's cache (the CPU backend has device 0 only).
rc=0; out=$("$cli" $t --device=1 smoke 2>&1) || rc=$?
[ $rc -eq 1 ] && grep -q "device must be in 0..0 (got 1)" <<<"$out" || fail "smoke --device=1: exit $rc $out"
rc=0; "$cli" $t --kv_scaling=STATIC --kv_scales=-1 smoke > "$log.smoke" 2>&1 || rc=$?
[ $rc -eq 1 ] && grep -q "kv_scaling applies to FLOAT8_E4M3" "$log.smoke" || fail "smoke of a bad scaling: exit $rc $(cat "$log.smoke")"
rm -f "$log.smoke"
[ "$("$cli" $t list | grep -c cacheId)" = 0 ] || fail "smoke left a cache behind"

hport=$(log_port "$log" health)
[ "$("$cli" --target=127.0.0.1:$hport health)" = "SERVING" ] || fail "health port"
stats=$("$cli" --metrics_target=127.0.0.1:$mport stats) || fail "stats"
# Four smokes of four Forwards each.
grep -q 'pagedattn_rpcs_total{method="Forward",code="OK"} 16' <<<"$stats" || fail "stats: $stats"

# The load generator: a mode that fails (ipc_tcp: the CPU backend takes no device tensors) ends
# the run, and its cache goes with it; an unknown mode is refused before anything runs.
small="--cases=1x16 --layers=1 --steps=1 --warmup=0 --echo_mib=0 --head_dim=64 --q_heads=2 --kv_heads=1"
rc=0; out=$("$loadgen" --target=127.0.0.1:$port --modes=ipc_tcp $small 2>&1) || rc=$?
[ $rc -eq 1 ] && grep -q "pagedattn-loadgen: ipc_tcp: " <<<"$out" || fail "loadgen ipc_tcp: exit $rc: $out"
[ "$("$cli" $t list | grep -c cacheId)" = 0 ] || fail "loadgen left its cache behind: $("$cli" $t list)"
rc=0; out=$("$loadgen" --target=127.0.0.1:$port --modes=unary_tcp,unray_uds $small 2>&1) || rc=$?
[ $rc -eq 2 ] && grep -q "unknown mode 'unray_uds' in --modes" <<<"$out" && ! grep -q prefill <<<"$out" ||
  fail "loadgen with an unknown mode: exit $rc: $out"

if [ -n "$py" ]; then
  # /metrics must parse with the reference Prometheus parser.
  "$py" - "127.0.0.1:$mport" <<'PY' || fail "metrics do not parse as Prometheus text"
import sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
text = urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=10).read().decode()
names = [f.name for f in text_string_to_metric_families(text)]
assert "pagedattn_rpcs" in names and "pagedattn_forward_latency_seconds" in names, names
print("metrics parse: OK,", len(names), "families")
PY
  # README's Metrics paragraph names what /metrics serves: no family served that it does not
  # name, none it names missing (the per-cache ones need --metrics_per_cache).
  "$py" - "127.0.0.1:$mport" "$(dirname "$0")/../../README.md" <<'PY' || fail "README's metrics"
import re, sys, urllib.request
text = urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=10).read().decode()
served = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
readme = open(sys.argv[2]).read()
section = readme[readme.index("**Metrics**"):readme.index("**Limits**")]
named = set()
for name, alt in re.findall(r"`(pagedattn_[a-z_]+)(?:\|([a-z]+))?", section):
    named.add(name)
    if alt:
        named.add(name[:name.rindex("_") + 1] + alt)
assert served - named == set(), f"served, not in README: {sorted(served - named)}"
missing = {n for n in named - served if not n.startswith("pagedattn_cache_")}
assert missing == set(), f"in README, not served: {sorted(missing)}"
print("README names every metric:", len(served))
PY
fi

# SIGHUP (`kill -HUP` from habit, a log rotator, a closed terminal) is logged and ignored: the
# server goes on serving (its default action ended the process at once, without a line).
kill -HUP $pid
for _ in $(seq 100); do grep -q "received SIGHUP" "$log" && break; sleep 0.05; done
grep -q "warning received SIGHUP: ignored" "$log" || fail "SIGHUP: no line saying it is ignored"
[ "$("$cli" $t health)" = "SERVING" ] || fail "not SERVING after SIGHUP"

kill -TERM $pid
rc=0; wait $pid || rc=$?
[ $rc -eq 0 ] || fail "server exit code $rc after SIGTERM"
grep -q "received SIGTERM" "$log" || fail "no shutdown log line"
# The grace's margin is said: calls in flight are stopped 1 s before the default 10 s end.
grep -q "10 s to drain (calls in flight are stopped 1 s before its end" "$log" ||
  fail "shutdown line without its margin: $(grep "received SIGTERM" "$log")"
grep -q "rpc Forward cache=" "$log" || fail "no per-RPC debug line"
grep -q "rpc GetCache cache=$id peer=[^ ]* req=cli-req-7 NOT_FOUND" "$log" ||
  fail "no req=cli-req-7 on describe's line: $(grep "rpc GetCache" "$log")"
grep -q "rpc ListCaches cache=- peer=[^ ]* req=cli-req-8 ok" "$log" ||
  fail "no req=cli-req-8 on list's line: $(grep "rpc ListCaches" "$log")"
echo "server_cli_test: all checks passed"
